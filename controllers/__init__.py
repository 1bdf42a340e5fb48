"""Placeholder package; see ARCHITECTURE.md for what lives here."""
