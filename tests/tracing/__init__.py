"""Tests of the tracing layer: `ModelTracer`, its sites, gradients, iterations and results."""
