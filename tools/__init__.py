"""Developer tools run from the checkout (not part of the installed package)."""
