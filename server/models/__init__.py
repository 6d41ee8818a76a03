"""Models pergrad serves: built-in ones and `.keras` files, each with versioned weights."""
