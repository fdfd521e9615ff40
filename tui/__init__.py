"""Textual apps: the live monitor and the report browser, each fed by an injected data source."""
