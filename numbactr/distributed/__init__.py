"""numbactr.distributed."""
