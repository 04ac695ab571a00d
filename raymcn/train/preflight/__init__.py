"""Checks before the first GPU-hour: static checks, the memory footprint estimate, convolution workspace."""
