"""numbactr.layers."""
