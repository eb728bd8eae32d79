# SPDX-License-Identifier: Apache-2.0
"""Worker-side checks for test_eagle3_async_spec_decode.py, sent to the
engine's worker with collective_rpc (a module of its own, importable by name
in the engine process, which gets this directory on sys.path).

install_checks(worker) wraps the model runner so that every step prepared
without waiting for the previous step's accepted counts is checked, after the
device correction, against v0.16.0's synchronous formulas evaluated on the
CPU: num_computed_tokens = optimistic - rejected drafts, positions and
seq_lens from it, slot = block_table[req, pos // block_size] * block_size +
pos % block_size (BlockTable.compute_slot_mapping without context
parallelism). It also counts the waits for accepted counts made while a step
is being prepared (_update_states), which the patch removes."""

from __future__ import annotations

from typing import Any


def install_checks(worker) -> dict[str, Any]:
    import numpy as np
    import torch

    mr = worker.model_runner
    stats: dict[str, Any] = {
        "use_async_spec_decode": bool(getattr(mr, "use_async_spec_decode", False)),
        "corrected_steps": 0,
        "requests_corrected": 0,
        "requests_with_rejections": 0,
        "rejected_drafts": 0,
        "tokens_checked": 0,
        "requests_moved_rows": 0,
        "mismatches": [],
        "waits_while_preparing": 0,
    }
    mr._async_spec_check_stats = stats
    state = {"in_update_states": False}

    orig_update_states = mr._update_states

    def update_states(scheduler_output):
        state["in_update_states"] = True
        try:
            return orig_update_states(scheduler_output)
        finally:
            state["in_update_states"] = False

    orig_get_counts = mr._get_valid_sampled_token_count

    def get_counts():
        if (
            state["in_update_states"]
            and mr.valid_sampled_token_count_event is not None
            and mr.input_batch.prev_sampled_token_ids is not None
        ):
            stats["waits_while_preparing"] += 1
        return orig_get_counts()

    orig_correct = getattr(mr, "_correct_optimistic_spec_inputs", None)

    def correct(num_reqs: int, num_tokens: int) -> None:
        orig_correct(num_reqs, num_tokens)
        torch.cuda.synchronize()
        valid = mr.valid_sampled_token_count_gpu.cpu().tolist()
        rejected = np.zeros(num_reqs, dtype=np.int64)
        for req in mr._optimistic_spec_reqs:
            i = mr.input_batch.req_id_to_index[req.req_id]
            rejected[i] = req.assumed_num_accepted - (valid[req.prev_req_index] - 1)
            stats["requests_corrected"] += 1
            stats["requests_with_rejections"] += int(rejected[i] > 0)
            stats["rejected_drafts"] += int(rejected[i])
            stats["requests_moved_rows"] += int(i != req.prev_req_index)
        qsl = mr.query_start_loc.np[: num_reqs + 1]
        req_of_token = np.repeat(np.arange(num_reqs), np.diff(qsl))
        # The CPU halves still hold what the CPU prepared (optimistic).
        exp_seq_lens = mr.seq_lens.np[:num_reqs].astype(np.int64) - rejected
        exp_positions = mr.positions.np[:num_tokens] - rejected[req_of_token]
        got = {
            "seq_lens": (mr.seq_lens.gpu[:num_reqs].cpu().numpy(), exp_seq_lens),
            "positions": (mr.positions.gpu[:num_tokens].cpu().numpy(), exp_positions),
        }
        for g, bt in enumerate(mr.input_batch.block_table.block_tables):
            blocks = bt.block_table.np[req_of_token, exp_positions // bt.block_size]
            exp_slots = blocks.astype(np.int64) * bt.block_size + exp_positions % bt.block_size
            got[f"slot_mapping[{g}]"] = (bt.slot_mapping.gpu[:num_tokens].cpu().numpy(), exp_slots)
        for name, (have, want) in got.items():
            if not np.array_equal(have.astype(np.int64), want.astype(np.int64)):
                if len(stats["mismatches"]) < 5:
                    stats["mismatches"].append(
                        {"step": stats["corrected_steps"], "what": name,
                         "got": have.tolist(), "expected": want.tolist()})
        stats["corrected_steps"] += 1
        stats["tokens_checked"] += num_tokens

    mr._update_states = update_states
    mr._get_valid_sampled_token_count = get_counts
    if orig_correct is not None:
        mr._correct_optimistic_spec_inputs = correct
    return dict(stats)


def read_checks(worker) -> dict[str, Any]:
    return dict(worker.model_runner._async_spec_check_stats)
