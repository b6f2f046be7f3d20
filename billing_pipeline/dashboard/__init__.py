"""The usage dashboard the billing service serves at /dashboard (docs/dashboard.md)."""
