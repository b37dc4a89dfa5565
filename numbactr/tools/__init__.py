"""numbactr.tools."""
