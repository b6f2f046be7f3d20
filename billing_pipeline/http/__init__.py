"""The billing service's HTTP routes, by audience: tenants (`/v1/usage...`, forwarded by ingress),
operators (`/admin/...`) and probes (`/health`, `/metrics`); service.py composes them."""
