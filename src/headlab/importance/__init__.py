"""importance."""
