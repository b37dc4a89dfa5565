"""numbactr.data."""
