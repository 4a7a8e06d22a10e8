"""vartrace on a CUDA GPU: syncs in the step, overhead, exactness and memory, in one command.

Usage::

    python tools/gpu_check.py --out results            # one CUDA GPU: at most 6 min on an H100
    python tools/gpu_check.py --out results --quick    # fewer timing rounds: about 3 min
    python tools/gpu_check.py --out results --no-csan  # without the CUDA-sanitizer child
    python tools/gpu_check.py --out results --compile  # + records under reduce-overhead compile
    python tools/gpu_check.py --smoke-cpu --out /tmp/gpu_smoke  # the control flow, tiny CPU model

The step: training a GPT-2-small-size model (12 blocks, d 768, 12 heads, seq 1024, batch 8,
vocab 50304; bf16 autocast, SDPA, fused AdamW, a frozen ``wpe``).  The sites: every block
output (``blocks.*``: 12 fp32 residuals, 302 MB a step) and ``wpe.weight`` (unchanged every
step, so change detection keeps it once).  Contenders, in one process: the untraced step;
forward hooks cloning on the device (the floor) or copying with a blocking ``.cpu()`` (what
peers do); vartrace with ``staging="sync"``, ``staging="async"``, async + a background HDF5
saver, async ``blocks.*@grad``, async statistics mode and ``device="cuda"``.  Options this
vartrace lacks are feature-detected; their contenders are skipped with the reason.

Per contender:

1. the step time, mean and median, and the mean's ratio to the untraced step's, over
   interleaved rounds (order reversed every other round, each step timed to a device sync);
   the rounds stop when the timing budget would be exceeded;
2. the extra peak device memory over the untraced step, and the tracer's ``staging_stats``;
3. bit-exactness of every recorded block output (and ``@grad``) against forward and tensor
   hooks copying the same tensors with a blocking ``.cpu()``; the HDF5 contender is read
   back from its file;
4. whether two traced steps survive ``torch.cuda.set_sync_debug_mode("error")``, and where
   they raised;
5. host-device synchronisations per step inside the step, by thread and innermost vartrace
   frame (``torch.cuda._gpu_trace`` callbacks; counted last: that trace slows what follows).

Then a child process under ``TORCH_CUDA_SANITIZER=1`` runs a few async-staged steps, and the
bars of the issues are printed, pass or fail (:data:`RATIO_BARS`: async <= 1.05x the
untraced step, mean and median, + HDF5 <= 1.10x, ``@grad`` <= 1.05x, ``device="cuda"``
<= 1.03x, tiny records <= 1.02x, statistics mode <= 1.03x), resident memory growth within
``max_host_bytes``, no sync in the step on the training and autograd threads (``vartrace-*``
threads may wait), sync-debug mode passes, 0 mismatches, 0 sanitizer races.  Every number
goes to ``<out>/gpu_check.json``; the table comes last.

``--smoke-cpu`` runs the same control flow on a tiny CPU model: the CUDA-only parts are
skipped with the reason, the async contenders too unless the tracer accepts
``staging="async"`` on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _gpu.contenders import contenders
from _gpu.exactness import compiled_check, exactness
from _gpu.logs import START, log
from _gpu.model import PLANS, Trainer, synchronize
from _gpu.report import BUDGET_S, bars, print_report
from _gpu.sanitizer import csan, csan_child
from _gpu.syncs import count_syncs, sync_debug
from _gpu.timing import bandwidth, time_contenders
from _harness import parser

import vartrace
from vartrace import ModelTracer


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--out", type=Path, default=Path("."), help="where gpu_check.json goes")
    arguments.add_argument("--quick", action="store_true", help="fewer timing rounds and steps")
    arguments.add_argument("--no-csan", action="store_true", help="skip the CUDA-sanitizer child")
    arguments.add_argument(
        "--compile", action="store_true", help="also check records under reduce-overhead"
    )
    arguments.add_argument("--smoke-cpu", action="store_true", help="the control flow on a CPU")
    arguments.add_argument("--csan-child", action="store_true", help=argparse.SUPPRESS)
    args = arguments.parse_args()
    if args.csan_child:
        csan_child()
        return
    if args.smoke_cpu:
        device, plan = torch.device("cpu"), PLANS["smoke"]
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: --smoke-cpu checks the script on a CPU")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        plan = PLANS["quick" if args.quick else "full"]
    cuda = device.type == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    size = plan.size
    env = {
        "torch": torch.__version__,
        "device_type": device.type,
        "cuda": torch.version.cuda if cuda else None,
        "python": sys.version.split()[0],
        "vartrace": vartrace.__version__,
        "vartrace_path": str(Path(vartrace.__file__).parent),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (--smoke-cpu)",
        "tracer_options": list(inspect.signature(ModelTracer).parameters),
        "plan": dataclasses.asdict(plan),
        "record_mb_per_step": size.layers * size.batch * size.seq * size.d * 4 / 1e6,
    }
    log(json.dumps(env))
    trainer = Trainer(size, device)
    for _ in range(3):
        trainer.step()
    synchronize(device)
    items = contenders(trainer)
    for c in items:
        if c.skip:
            log(f"skipping {c.name}: {c.skip}")
    env["stats_reducer"] = next(c.note for c in items if c.name == "vartrace async stats")
    running = [c for c in items if not c.skip]
    no_async = next(c.skip for c in items if c.name == "vartrace async")
    result: dict[str, Any] = {"env": env, "skipped": {c.name: c.skip for c in items if c.skip}}
    if cuda:
        result["bandwidth"] = bandwidth(device)
        log(f"bandwidth {result['bandwidth']}")
    else:
        log("skipping bandwidth, sync-debug mode, sync counts: CUDA only")
    log(f"timing {len(running)} contenders ...")
    result["timing"] = time_contenders(trainer, running, plan)
    log("exactness ...")
    result["exactness"] = exactness(trainer, running, plan.exact_steps)
    if cuda:
        log("sync-debug mode 'error' ...")
        result["sync_debug"] = sync_debug(trainer, running)
    if args.compile:
        log("torch.compile(mode='reduce-overhead') ...")
        result["compiled"] = compiled_check(size, device, 6, async_ok=not no_async)
        log(f"  {result['compiled']}")
    if cuda:
        log("sync counts ...")  # last in this process: the GPU trace stays on
        result["syncs"] = count_syncs(trainer, running, plan.sync_steps)
    if args.no_csan:
        result["csan"] = {"skipped": "--no-csan"}
    elif not cuda:
        result["csan"] = {"skipped": "CUDA only"}
    elif no_async:
        result["csan"] = {"skipped": f"nothing async to sanitize: {no_async}"}
    else:
        timeout = max(60.0, BUDGET_S - (time.perf_counter() - START) - 10)
        log(f"CUDA sanitizer child (timeout {timeout:.0f}s) ...")
        result["csan"] = csan(timeout)
    if "skipped" in result["csan"]:
        log(f"skipping the CUDA sanitizer: {result['csan']['skipped']}")
    result["bars"] = [
        {"bar": bar, "measured": measured, "verdict": verdict}
        for bar, measured, verdict in bars(result, items)
    ]
    result["seconds"] = time.perf_counter() - START
    out = args.out / "gpu_check.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print_report(result, items, out)


if __name__ == "__main__":
    main()
