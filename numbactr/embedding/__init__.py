"""numbactr.embedding."""
