# SPDX-License-Identifier: Apache-2.0
"""Worker-side probe for test_eagle3_async_spec_decode.py, sent to the
engine's worker with collective_rpc (a module of its own, importable by name
in the engine process, which gets this directory on sys.path).

install_sync_probe(worker) wraps the model runner so that every step is
prepared under torch.cuda.set_sync_debug_mode("warn"): from the start of
execute_model (_update_states, _prepare_inputs with its device correction,
the attention metadata) until the forward is launched (_model_forward), where
the mode is switched off again. Every synchronizing CUDA call in that stretch
is recorded with the Python line that made it (in the step's own thread),
per step, with the step's kind: whether it was prepared without waiting for the previous step's
accepted counts (the runner's _optimistic_spec_reqs after _update_states)
and whether it has prefill rows. Nothing here synchronizes the device but
the control at install: one .item() under the same capture, which must be
seen.
"""

from __future__ import annotations

from typing import Any

MAX_RECORDED = 40


def install_sync_probe(worker) -> dict[str, Any]:
    import threading
    import warnings

    import torch

    mr = worker.model_runner
    stats: dict[str, Any] = {
        "use_async_spec_decode": bool(getattr(mr, "use_async_spec_decode", False)),
        "steps": 0,
        "optimistic_steps": 0,
        "optimistic_decode_steps": 0,
        "syncs": [],  # first MAX_RECORDED: {step, optimistic, prefill, where, message}
        "syncs_in_optimistic_decode_steps": 0,
        "syncs_in_other_steps": 0,
    }
    mr._sync_probe_stats = stats

    # The control: the same capture sees a known host sync (.item()).
    seen: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: seen.append(str(message))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.ones(1, device=mr.device).item()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    stats["control_item_seen"] = any("synchroniz" in m for m in seen)
    state: dict[str, Any] = {"optimistic": False}

    orig_execute = mr.execute_model
    orig_prepare = mr._prepare_inputs
    orig_forward = mr._model_forward

    def prepare_inputs(scheduler_output, *args, **kwargs):
        # _update_states has run: its optimistic requests are known.
        state["optimistic"] = bool(getattr(mr, "_optimistic_spec_reqs", None))
        return orig_prepare(scheduler_output, *args, **kwargs)

    def model_forward(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)  # the prepared path ends here
        return orig_forward(*args, **kwargs)

    def execute_model(scheduler_output, *args, **kwargs):
        spec = scheduler_output.scheduled_spec_decode_tokens
        prefill = bool(scheduler_output.scheduled_new_reqs) or any(
            n != 1 + len(spec.get(r, ())) for r, n in scheduler_output.num_scheduled_tokens.items())
        state["optimistic"] = False
        step = stats["steps"]
        thread = threading.get_ident()
        syncs: list = []
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def showwarning(message, category, filename, lineno, file=None, line=None):
                # This step's thread only: the engine copies outputs in another.
                if threading.get_ident() == thread and "synchroniz" in str(message):
                    syncs.append(warnings.WarningMessage(message, category, filename, lineno))
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = showwarning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return orig_execute(scheduler_output, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                stats["steps"] += 1
                stats["optimistic_steps"] += int(state["optimistic"])
                decode = state["optimistic"] and not prefill
                stats["optimistic_decode_steps"] += int(decode)
                key = "syncs_in_optimistic_decode_steps" if decode else "syncs_in_other_steps"
                stats[key] += len(syncs)
                for w in syncs:
                    if len(stats["syncs"]) < MAX_RECORDED:
                        stats["syncs"].append({
                            "step": step, "optimistic": state["optimistic"], "prefill": prefill,
                            "where": f"{w.filename}:{w.lineno}", "message": str(w.message)[:200]})

    mr.execute_model = execute_model
    mr._prepare_inputs = prepare_inputs
    mr._model_forward = model_forward
    return dict(stats)


def read_sync_probe(worker) -> dict[str, Any]:
    return dict(worker.model_runner._sync_probe_stats)


def remove_sync_probe(worker) -> None:
    mr = worker.model_runner
    for name in ("execute_model", "_prepare_inputs", "_model_forward"):
        mr.__dict__.pop(name, None)
