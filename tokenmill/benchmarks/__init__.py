"""Every benchmark (`tokenmill bench <name>`): each prints a table and writes JSON, and reports the
machine it ran on (report.py). One percentile definition for all of them (report.percentile)."""
