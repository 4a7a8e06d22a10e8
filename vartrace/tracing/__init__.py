"""The record path's front: `ModelTracer` and what it attaches to a model.

Patterns are resolved against the model (`sites`), values are captured by the engine
and by gradient hooks (`gradients`), copied and compared (`tensors`), counted into
iterations (`iterations`), and kept in memory (`results`) until the tracer hands a
chunk on to the callbacks, the gather (`vartrace.distributed`) and the sinks.  This
package imports torch only in the modules that need it: `manual` (`vartrace.record`)
is imported by `import vartrace` and stays torch-free.
"""
