"""`torch._dynamo` (seconds of CPU to import) is imported only where a model is compiled:
not by `import vartrace`, nor by building, starting and stopping a tracer on an eager
model; a model compiled after the tracer started (dynamo imported then) still runs the
tracer's code eagerly.  Each case runs in a fresh interpreter, where nothing imported
dynamo before."""

from __future__ import annotations

import textwrap

from tests._env import run_script


def test_import_and_model_tracer_import_no_dynamo() -> None:
    done = run_script(
        "import vartrace; vartrace.ModelTracer\n"
        "import sys; assert 'torch._dynamo' not in sys.modules\n",
        flags=["-X", "importtime"],
    )
    assert "torch._dynamo" not in done.stderr  # -X importtime lists every module imported


def test_tracing_an_eager_model_imports_no_dynamo() -> None:
    run_script(
        textwrap.dedent(
            """
            import sys
            import vartrace
            from tests._models import TinyTransformer, tokens
            model = TinyTransformer()
            with vartrace.ModelTracer(model, ["layers.*.attn.forward.scores"]) as tracer:
                model(tokens(0))
            assert tracer.results["layers.0.attn.forward.scores"].iterations == [1]
            assert "torch._dynamo" not in sys.modules, "torch._dynamo imported"
            """
        )
    )


def test_a_model_compiled_after_start_in_a_fresh_process_runs_traced_code_eagerly() -> None:
    done = run_script(
        textwrap.dedent(
            """
            import sys, warnings
            import torch
            import vartrace
            from tests._models import TinyTransformer, tokens
            ops = []
            def graphs(gm, inputs):
                ops.extend(str(n.target) for n in gm.graph.nodes if n.op.startswith("call_"))
                return gm.forward
            model = TinyTransformer()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with vartrace.ModelTracer(model, ["head.forward.input"]) as tracer:
                    assert "torch._dynamo" not in sys.modules
                    compiled = torch.compile(model, backend=graphs)
                    for step in range(2):
                        compiled(tokens(step))
            assert tracer.results["head.forward.input"].iterations == [1, 2]
            said = [str(w.message) for w in caught if str(w.message).startswith("vartrace")]
            assert len(said) == 1 and "compiled" in said[0], said
            assert any("softmax" in op for op in ops), ops  # the rest stayed compiled
            """
        )
    )
    assert done.returncode == 0


def test_an_eager_model_records_outside_dynamos_wrapper_once_dynamo_is_imported() -> None:
    run_script(
        textwrap.dedent(
            """
            import sys
            import torch
            import vartrace
            from tests._models import TinyTransformer, tokens
            model = TinyTransformer()
            # An optimizer imports torch._dynamo: a training script has it, compiling or not.
            torch.optim.SGD(model.parameters(), lr=0.1)
            assert "torch._dynamo" in sys.modules
            stacks = []
            def files(name, value, iteration):
                frame = sys._getframe()
                while frame is not None:
                    stacks.append(frame.f_code.co_filename)
                    frame = frame.f_back
                return value
            with vartrace.ModelTracer(model, ["layers.*.attn.forward.scores"],
                                      pre_save_callbacks=[files]) as tracer:
                model(tokens(0))
            assert tracer.results["layers.0.attn.forward.scores"].iterations == [1]
            assert stacks and not [f for f in stacks if "_dynamo" in f], set(stacks)
            """
        )
    )
