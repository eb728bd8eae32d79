# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Async scheduling + spec decode without the wait for the previous step's
accepted counts (#32951's behaviour): the CPU prepares a step as if every
draft had been accepted, the device corrects positions, seq_lens and slot
mappings, and the CPU state is corrected after the forward.

Both corrections are checked against the synchronous path written out here
request by request: num_computed_tokens = scheduler's value - rejected drafts,
then positions, seq_lens and slot mappings from it, and v0.16.0's placeholder
bookkeeping for output_token_ids."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from vllm.v1.spec_decode.utils import correct_optimistic_spec_decode_inputs

PAD_POSITION = -7  # positions/slots past num_tokens must stay untouched
PAD_SLOT = -9


def _slot(block_table: list[list[int]], block_size: int, req: int, pos: int) -> int:
    return block_table[req][pos // block_size] * block_size + pos % block_size


def _batch(rng: random.Random, num_reqs: int, num_spec: int, block_sizes):
    """One step: per request its true num_computed_tokens, the drafts of the
    previous step the CPU assumed accepted (0: nothing to correct), how many
    the sampler accepted, and this step's scheduled tokens. The previous
    step's rows are a shuffled superset of the current requests."""
    prev_rows = list(range(num_reqs + rng.randint(0, 3)))
    rng.shuffle(prev_rows)
    reqs = []
    for i in range(num_reqs):
        kind = rng.choice(["decode", "decode", "decode", "new", "no_drafts"])
        if kind == "decode":
            assumed = rng.randint(1, num_spec)
            accepted = rng.randint(0, assumed)
            prev = prev_rows[i]
            num_sched = 1 + rng.randint(0, num_spec)
        else:
            assumed = accepted = 0
            prev = -1
            num_sched = rng.randint(1, 9) if kind == "new" else 1
        computed = rng.randint(0, 40)
        reqs.append(
            dict(prev=prev, assumed=assumed, accepted=accepted,
                 computed=computed, num_sched=num_sched)
        )
    max_len = max(r["computed"] + r["assumed"] + r["num_sched"] for r in reqs)
    tables = []
    for bs in block_sizes:
        blocks_per_req = -(-max_len // bs) + 1
        # distinct, shuffled physical block ids per (request, group)
        ids = list(range(1, num_reqs * blocks_per_req + 1))
        rng.shuffle(ids)
        rows = [ids[r * blocks_per_req:(r + 1) * blocks_per_req]
                for r in range(num_reqs)]
        # rows for requests that are not in this batch, as in the runner
        rows += [[0] * blocks_per_req for _ in range(2)]
        tables.append((bs, rows))
    valid_counts = [rng.randint(0, num_spec + 1) for _ in prev_rows]
    for r in reqs:
        if r["prev"] >= 0:
            valid_counts[r["prev"]] = r["accepted"] + 1
    return reqs, tables, valid_counts


def _run(reqs, tables, valid_counts, device="cpu"):
    num_reqs = len(reqs)
    # What the CPU prepares: the scheduler's optimistic num_computed_tokens,
    # which counts every assumed draft as accepted.
    optimistic = [r["computed"] + r["assumed"] - r["accepted"] for r in reqs]
    num_sched = [r["num_sched"] for r in reqs]
    num_tokens = sum(num_sched)
    query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(num_sched)]),
                                   dtype=torch.int32)
    positions = torch.full((num_tokens + 5,), PAD_POSITION, dtype=torch.int64)
    positions[:num_tokens] = torch.tensor(
        [optimistic[i] + j for i in range(num_reqs) for j in range(num_sched[i])]
    )
    seq_lens = torch.full((num_reqs + 3,), 0, dtype=torch.int32)
    seq_lens[:num_reqs] = torch.tensor(
        [optimistic[i] + num_sched[i] for i in range(num_reqs)]
    )
    groups = []
    for bs, rows in tables:
        slots = torch.full((num_tokens + 5,), PAD_SLOT, dtype=torch.int64)
        slots[:num_tokens] = torch.tensor(
            [_slot(rows, bs, i, optimistic[i] + j)
             for i in range(num_reqs) for j in range(num_sched[i])]
        )
        groups.append((torch.tensor(rows, dtype=torch.int32), bs, slots))

    def dev(t):
        return t.to(device)

    positions, seq_lens, query_start_loc = dev(positions), dev(seq_lens), dev(query_start_loc)
    groups = [(dev(table), bs, dev(slots)) for table, bs, slots in groups]
    correct_optimistic_spec_decode_inputs(
        dev(torch.tensor([r["prev"] for r in reqs], dtype=torch.int64)),
        dev(torch.tensor([r["assumed"] for r in reqs], dtype=torch.int32)),
        dev(torch.tensor(valid_counts, dtype=torch.int32)),
        query_start_loc,
        num_tokens,
        seq_lens,
        positions,
        groups,
    )
    return num_tokens, positions, seq_lens, groups


def _expected(reqs, tables):
    """The synchronous path, one request and one token at a time."""
    positions, seq_lens, slots = [], [], [[] for _ in tables]
    for i, r in enumerate(reqs):
        seq_lens.append(r["computed"] + r["num_sched"])
        for j in range(r["num_sched"]):
            pos = r["computed"] + j
            positions.append(pos)
            for g, (bs, rows) in enumerate(tables):
                slots[g].append(_slot(rows, bs, i, pos))
    return positions, seq_lens, slots


def test_correction_by_hand():
    """Four requests, block size 4; previous rows in another order."""
    reqs = [
        # 3 drafts, 1 accepted: optimistic 12 + 2 -> true 10
        dict(prev=2, assumed=3, accepted=1, computed=10, num_sched=4),
        # all 3 accepted: nothing changes
        dict(prev=0, assumed=3, accepted=3, computed=7, num_sched=4),
        # a new request's prefill chunk: exact already
        dict(prev=-1, assumed=0, accepted=0, computed=0, num_sched=5),
        # 2 drafts, none accepted, crossing back over a block boundary
        dict(prev=1, assumed=2, accepted=0, computed=15, num_sched=3),
    ]
    table = [[5, 9, 2, 7, 11, 3], [1, 4, 6, 8, 10, 12],
             [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24]]
    valid_counts = [4, 1, 2]  # rows of the previous step
    num_tokens, positions, seq_lens, groups = _run(reqs, [(4, table)], valid_counts)

    assert seq_lens[:4].tolist() == [14, 11, 5, 18]
    assert positions[:num_tokens].tolist() == [
        10, 11, 12, 13, 7, 8, 9, 10, 0, 1, 2, 3, 4, 15, 16, 17]
    # request 3, position 15: block 3 of its row (22), offset 3
    assert groups[0][2][13].item() == 22 * 4 + 3
    # request 3, position 16: block 4 (23), offset 0
    assert groups[0][2][14].item() == 23 * 4


@pytest.mark.parametrize("seed", range(20))
def test_correction_matches_synchronous_path(seed):
    rng = random.Random(seed)
    reqs, tables, valid_counts = _batch(
        rng, num_reqs=rng.randint(1, 12), num_spec=rng.randint(1, 5),
        block_sizes=(16, 4),
    )
    num_tokens, positions, seq_lens, groups = _run(reqs, tables, valid_counts)
    exp_positions, exp_seq_lens, exp_slots = _expected(reqs, tables)
    num_reqs = len(reqs)

    assert positions[:num_tokens].tolist() == exp_positions
    assert seq_lens[:num_reqs].tolist() == exp_seq_lens
    for (_, _, slots), exp in zip(groups, exp_slots):
        assert slots[:num_tokens].tolist() == exp
        # the padded tail (CUDA graph padding) is left alone
        assert (slots[num_tokens:] == PAD_SLOT).all()
    assert (positions[num_tokens:] == PAD_POSITION).all()
    assert (seq_lens[num_reqs:] == 0).all()


@pytest.mark.parametrize("seed", range(10))
def test_cpu_state_correction_matches_synchronous_path(seed):
    """After the forward, num_computed_tokens and output_token_ids must be
    what v0.16.0's synchronous _update_states computes."""
    from vllm.v1.worker import gpu_model_runner as gmr

    rng = random.Random(seed)
    num_reqs = rng.randint(1, 8)
    prev_rows = list(range(num_reqs))
    rng.shuffle(prev_rows)
    valid_counts = [0] * num_reqs
    optimistic_reqs = []
    expected = {}
    batch_rows = list(range(num_reqs))
    rng.shuffle(batch_rows)  # condense/reorder moved them
    num_computed_cpu = np.zeros(num_reqs + 2, dtype=np.int32)
    # the step's seq_lens as prepared (one token scheduled per request)
    seq_lens_cpu = torch.zeros(num_reqs + 2, dtype=torch.int32)
    for i in range(num_reqs):
        req_id = f"r{i}"
        drafts = rng.randint(1, 4)
        accepted = rng.randint(0, drafts)
        valid_counts[prev_rows[i]] = accepted + 1
        scheduler_computed = rng.randint(20, 60)  # counts all drafts
        base = [rng.randint(0, 99) for _ in range(rng.randint(1, 6))] + [-1]
        # the scheduler's output count: placeholders for every draft, or
        # fewer (tokens discarded after a KV load failure)
        num_output_tokens = len(base) + drafts - rng.choice([0, 0, 0, 1, 2])

        # synchronous path (v0.16.0 _update_states)
        sync_out = base + [-1] * accepted
        del sync_out[num_output_tokens:]
        expected[req_id] = (scheduler_computed - (drafts - accepted), sync_out)

        # optimistic path, as _update_states leaves it
        out = base + [-1] * drafts
        del out[num_output_tokens:]
        state = SimpleNamespace(num_computed_tokens=scheduler_computed,
                                output_token_ids=out)
        num_computed_cpu[batch_rows[i]] = scheduler_computed
        seq_lens_cpu[batch_rows[i]] = scheduler_computed + 1
        optimistic_reqs.append(gmr._OptimisticSpecRequest(
            req_id, state, prev_rows[i], drafts, len(base), num_output_tokens))

    fake_runner = SimpleNamespace(
        _optimistic_spec_reqs=optimistic_reqs,
        _get_valid_sampled_token_count=lambda: list(valid_counts),
        input_batch=SimpleNamespace(
            req_id_to_index={f"r{i}": batch_rows[i] for i in range(num_reqs)},
            num_computed_tokens_cpu=num_computed_cpu,
            num_reqs=num_reqs,
        ),
        seq_lens=SimpleNamespace(cpu=seq_lens_cpu),
    )
    gmr.GPUModelRunner._correct_optimistic_spec_state(fake_runner)

    assert fake_runner._optimistic_spec_reqs == []
    for i, req in enumerate(optimistic_reqs):
        exp_computed, exp_out = expected[req.req_id]
        assert req.req_state.num_computed_tokens == exp_computed
        assert req.req_state.output_token_ids == exp_out
        assert num_computed_cpu[batch_rows[i]] == exp_computed
        # what the drafter reads after the forward: exact, in a copy
        assert fake_runner._spec_exact_seq_lens_cpu[batch_rows[i]] == exp_computed + 1
        assert seq_lens_cpu[batch_rows[i]] == req.req_state.num_computed_tokens + 1 + (
            req.assumed_num_accepted - (valid_counts[prev_rows[i]] - 1))


class RefuseHostSync(TorchDispatchMode):
    """Fails any op that makes the host wait for the device: reading a value
    (.item(), int(), bool(), what .tolist() does on a device tensor),
    data-dependent shapes (nonzero, masked_select, unique) and copies to the
    host. Counts the ops it let through."""

    REFUSED = {
        torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero,
        torch.ops.aten.masked_select, torch.ops.aten._unique2,
        torch.ops.aten.unique_consecutive, torch.ops.aten.unique_dim,
    }

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in self.REFUSED:
            raise AssertionError(f"host sync in the correction: {func}")
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
            src = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
            dst = (args[0].device if func.overloadpacket is torch.ops.aten.copy_
                   else kwargs.get("device") or src.device)
            if torch.device(dst).type == "cpu" and src.device.type != "cpu":
                raise AssertionError(f"device-to-host copy in the correction: {func}")
        self.ops += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("seed", range(4))
def test_correction_never_waits_for_the_device(seed):
    """The correction runs while the previous step is still on the device;
    a host read in it brings back the wait the change removes. On meta
    tensors (shapes, no data) any read of a value fails, .tolist() and
    .numpy() included; the dispatch mode fails the reads and
    data-dependent ops that do not need the data to be absent. On CPU
    tensors the same mode lets the real computation through."""
    rng = random.Random(seed)
    batch = _batch(rng, num_reqs=rng.randint(2, 10), num_spec=3, block_sizes=(16, 4))
    for device in ("meta", "cpu"):
        with RefuseHostSync() as mode:
            num_tokens, positions, seq_lens, groups = _run(*batch, device=device)
        assert mode.ops > 0
        assert positions.device.type == seq_lens.device.type == device
    # The CPU run under the mode still computes the synchronous path's values.
    exp_positions, exp_seq_lens, exp_slots = _expected(batch[0], batch[1])
    assert positions[:num_tokens].tolist() == exp_positions
    assert [g[2][:num_tokens].tolist() for g in groups] == exp_slots
