"""Reading runs after the fact: uniform sources, `compare`, plots, TensorBoard export."""
