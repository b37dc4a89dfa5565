"""numbactr.autograd."""
