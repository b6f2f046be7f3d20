"""Helpers the test packages share: waiting for a state instead of sleeping, and the stack's tenants."""
