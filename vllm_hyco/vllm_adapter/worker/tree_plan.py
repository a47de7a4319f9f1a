"""Per-step tree plan shared by the runner mixin and the attention overrides (vLLM-free, torch only).

For every HyCo request scheduled with a tree this step, the runner builds one :class:`TreeRows`: where
its rows sit in the flattened batch, the committed context length ``t`` (the root's position), each
row's depth and its ancestor mask. The attention override reads it to mask tree rows and records, once
per layer and step, that it wrote the step's K/V (:func:`note_layer_written`; no copy of the rows: the
compaction and the hand-off read the paged cache, ``vllm_adapter/worker/tree_step.py``).

The runner publishes the step's trees with :func:`set_active_trees` and clears them after sampling. The
CPU override reads the list (:func:`active_trees`); the GPU backend reads :func:`active_step`, a
:class:`TreeStep` (the trees plus their rows, masks and depths stacked on the runner's device), built on its
first call of the step and kept for the step's other layers, so there is no host-to-device copy per layer
and the CPU path never builds one.

Masks and depths come from the tree contract (``vllm_hyco.handoff.tree_contract``, numpy): int64 bit masks
(the form the kernels and their torch twin take); this module turns them into tensors, once per tree shape
(:func:`shape_tensors`: the adaptive cut sends the same few shapes, chains mostly).

Example (a root with two children, the second having one child)::

    >>> tr = TreeRows.build(req_id="a", batch_idx=0, q_start=0, num_rows=4, context_len=9, round=0,
    ...                     tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 2], eps=None)
    >>> tr.depths.tolist(), tr.masks.tolist()
    ([0, 1, 1, 2], [1, 3, 5, 13])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_hyco.handoff import tree_contract
from vllm_hyco.spec_decode.budget import recomputed


@dataclass
class TreeRows:
    """One tree request in one step."""

    req_id: str
    batch_idx: int
    q_start: int  # first row of this request in the flattened batch
    num_rows: int  # rows scheduled (root + nodes; may be cut short by the token budget)
    context_len: int  # t: committed positions [0, t) are in the cache; the root sits at t
    round: int
    tokens: list[int]  # [num_rows] root first
    parents: list[int]  # [num_rows]
    eps: float | None
    depths: torch.Tensor  # [num_rows] int64
    masks: torch.Tensor  # [num_rows] int64 ancestor bitmask (bit j: row j is an ancestor or the row)
    host_s: float = 0.0  # host time spent on this tree outside the model (plan, decision, compaction, hand-off)
    draft_q: dict | None = None  # sampled rows' q, {row: (ids, weights)} (rows past num_rows are ignored)
    seed: bool = False  # the hand-off carries the window's K/V (round 0, the round after server mode)

    @classmethod
    def build(cls, *, req_id: str, batch_idx: int, q_start: int, num_rows: int, context_len: int,
              round: int, tokens: list[int], parents: list[int], eps: float | None,
              draft_q: dict | None = None, seed: bool | None = None) -> TreeRows:
        tokens, parents = list(tokens[:num_rows]), list(parents[:num_rows])  # a prefix of a tree is a tree
        return cls(req_id=req_id, batch_idx=batch_idx, q_start=q_start, num_rows=num_rows,
                   context_len=context_len, round=round, tokens=tokens, parents=parents, eps=eps, draft_q=draft_q,
                   seed=round == 0 if seed is None else seed,
                   depths=(shape := shape_tensors(tuple(parents)))[0], masks=shape[1])

    @property
    def positions(self) -> torch.Tensor:
        """[num_rows] int64: t + depth."""
        return self.context_len + self.depths


@functools.lru_cache(maxsize=4096)
def shape_tensors(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] int64 depths and [n] int64 ancestor masks of a tree shape, shared by every tree of that shape
    (read only; the contract's errors are raised, not cached)."""
    return torch.from_numpy(tree_contract.depths(parents)), torch.from_numpy(tree_contract.ancestor_mask(parents))


@dataclass
class TreeStep:
    """The step's trees as the GPU backend needs them, on the runner's device (built once per step)."""

    trees: list[TreeRows]
    # [T] int64 batch index of each tree request (rows of attn_metadata.block_table)
    batch_idx: torch.Tensor
    # [R] int64 flattened-batch row of each tree row, tree after tree
    rows: torch.Tensor
    # [R] int64 ancestor bitmasks and [R] int32 depths, same order
    masks: torch.Tensor
    depths: torch.Tensor
    row_counts: list[int]
    context_lens: list[int]
    # [T + 1] int32 cumulative rows and [T] int32 t + n, on the device (the kernel's metadata, built once)
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def build(cls, trees: list[TreeRows], device: torch.device | str = "cpu") -> TreeStep:
        """Stack the trees' rows, masks and depths (tree after tree) and move them to ``device``.

        >>> tr = TreeRows.build(req_id="a", batch_idx=1, q_start=3, num_rows=3, context_len=7, round=0,
        ...                     tokens=[5, 6, 7], parents=[-1, 0, 0], eps=None)
        >>> st = TreeStep.build([tr])
        >>> st.rows.tolist(), st.masks.tolist(), st.context_lens
        ([3, 4, 5], [1, 3, 5], [7])
        """
        rows = [torch.arange(tr.q_start, tr.q_start + tr.num_rows, dtype=torch.int64) for tr in trees]
        counts = torch.tensor([tr.num_rows for tr in trees], dtype=torch.int32)
        ctx = torch.tensor([tr.context_len for tr in trees], dtype=torch.int32)
        return cls(
            trees=list(trees),
            batch_idx=torch.tensor([tr.batch_idx for tr in trees], dtype=torch.int64).to(device),
            rows=torch.cat(rows).to(device),
            masks=torch.cat([tr.masks for tr in trees]).to(device),
            depths=torch.cat([tr.depths for tr in trees]).to(device=device, dtype=torch.int32),
            row_counts=[tr.num_rows for tr in trees],
            context_lens=[tr.context_len for tr in trees],
            query_start_loc=torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32).to(device),
            seq_lens=(ctx + counts).to(device),
        )


@dataclass
class PaddedTrees:
    """The step's trees padded to one batch, for the CPU override's one gather and one attention per layer.

    ``T`` trees, ``R`` = the most rows of any tree, ``L`` = the most prefix keys of any tree (the keys a
    row can see below the root: all committed positions, or the window's tail on a sliding layer). Keys
    of tree b are its prefix (positions ``lo_b ..``) then its own rows, so the visibility
    ``vis [T, R, L + R]`` is the one-request rule of ``kernels.tree_attention.visibility_mask`` per tree,
    with padding masked out; a padded row sees only itself (no all-masked row). The layout depends on the
    window only; the cache slots of its keys depend on the layer's block table (:meth:`slots`: each KV-cache
    group has its own)."""

    rows: torch.Tensor  # [T, R] int64 flattened-batch row (padding: the tree's root row)
    valid: torch.Tensor  # [T, R] bool
    batch_idx: list[int]  # [T] rows of the block table
    positions: torch.Tensor  # [T, L + R] int64 position of every key (padding: 0, masked)
    prefix_ok: torch.Tensor  # [T, L] bool: a real prefix key (padding reads a slot that may hold anything)
    vis: torch.Tensor  # [T, R, L + R] bool
    bias: torch.Tensor  # [T, R, L + R] float32: 0 where visible, -inf elsewhere (added to the scores)

    @classmethod
    def build(cls, trees: list[TreeRows], sliding_window: int | None) -> PaddedTrees:
        """
        >>> a = TreeRows.build(req_id="a", batch_idx=0, q_start=0, num_rows=3, context_len=2, round=0,
        ...                    tokens=[5, 6, 7], parents=[-1, 0, 0], eps=None)
        >>> b = TreeRows.build(req_id="b", batch_idx=1, q_start=3, num_rows=1, context_len=4, round=0,
        ...                    tokens=[9], parents=[-1], eps=None)
        >>> pt = PaddedTrees.build([a, b], None)
        >>> pt.rows.tolist(), pt.positions.tolist()
        ([[0, 1, 2], [3, 3, 3]], [[0, 1, 0, 0, 2, 3, 4], [0, 1, 2, 3, 4, 0, 0]])
        >>> pt.vis[0].int().tolist()   # row 2 sees the prefix, the root and itself, not its sibling
        [[1, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 0, 1]]
        >>> [x.tolist() for x in pt.slots(torch.tensor([[0], [1]]), 8)]   # (prefix, tree rows)
        [[[0, 1, 0, 0], [8, 9, 10, 11]], [[2, 3, 4], [12, 8, 8]]]
        """
        T, R = len(trees), max(tr.num_rows for tr in trees)
        n = torch.tensor([tr.num_rows for tr in trees])  # [T]
        t = torch.tensor([tr.context_len for tr in trees])  # [T]
        lo = torch.zeros_like(t) if not sliding_window else (t - sliding_window + 1).clamp(min=0)
        pre = t - lo  # [T] prefix keys of each tree
        L = int(pre.max())
        r = torch.arange(R)
        valid = r[None] < n[:, None]  # [T, R]
        q_start = torch.tensor([tr.q_start for tr in trees])
        rows = torch.where(valid, q_start[:, None] + r[None], q_start[:, None])
        masks = torch.zeros(T, R, dtype=torch.int64)
        depths = torch.zeros(T, R, dtype=torch.int64)
        for b, tr in enumerate(trees):
            masks[b, :tr.num_rows] = tr.masks
            depths[b, :tr.num_rows] = tr.depths
        j = torch.arange(L)
        key_ok = j[None] < pre[:, None]  # [T, L]
        vis_pre = key_ok[:, None, :].expand(T, R, L)
        vis_tree = (((masks[:, :, None] >> r.clamp(max=63)[None, None, :]) & 1) != 0) & valid[:, None, :]
        if sliding_window:  # key position > row position - window (positions t + depth for the rows)
            row_pos = t[:, None] + depths  # [T, R]
            vis_pre = vis_pre & ((lo[:, None] + j[None])[:, None, :] > (row_pos - sliding_window)[:, :, None])
            vis_tree = vis_tree & (row_pos[:, None, :] > (row_pos - sliding_window)[:, :, None])
        vis_tree = vis_tree | (torch.eye(R, dtype=torch.bool)[None] & ~valid[:, :, None])  # padded: itself
        vis = torch.cat([vis_pre & valid[:, :, None], vis_tree], 2)
        positions = torch.cat([torch.where(key_ok, lo[:, None] + j[None], 0),
                               torch.where(valid, t[:, None] + r[None], 0)], 1)
        return cls(rows=rows, valid=valid, batch_idx=[tr.batch_idx for tr in trees], positions=positions,
                   prefix_ok=key_ok, vis=vis, bias=torch.zeros(vis.shape).masked_fill_(~vis, float("-inf")))

    def slots(self, block_table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, L] prefix-key slots, [T, R] tree-row slots) in the layer's ``[batch, max_blocks]`` table.
        Padding reads the slot of position 0, whose block a sliding group may have freed and reused: the
        caller zeroes what padding gathers (``prefix_ok``, ``valid``), since a masked key that holds NaN
        still poisons the attention."""
        bt = block_table.to(torch.int64)[self.batch_idx]  # [T, max_blocks]
        p = self.positions
        s = bt.gather(1, p // block_size) * block_size + p % block_size
        L = p.shape[1] - self.rows.shape[1]
        return s[:, :L], s[:, L:]


# This step's trees and the device they run on; the trees whose rows the attention overrides recompute;
# the stacked TreeStep of those, built on first use; the names of the layers whose KV-cache write ran
# while the trees were active; per-step layouts keyed by the caller.
_ACTIVE: dict = {"trees": None, "masked": None, "device": "cpu", "step": None, "written": set(), "cache": {},
                 "full_graph": False, "tokens": 0}


def set_active_trees(trees: list[TreeRows] | None, device: torch.device | str = "cpu", tokens: int = 0) -> None:
    """Publish this step's trees (None or [] clears) and its scheduled rows (``tokens``); everything runs in the
    worker process."""
    trees = trees or None
    masked = ([tr for tr in trees if recomputed(tr.parents)] or None) if trees else None
    _ACTIVE.update(trees=trees, masked=masked, device=device, step=None, written=set(), cache={}, full_graph=False,
                   tokens=int(tokens))


def step_tokens() -> int:
    """The step's scheduled rows, every request's (the MLA override finds its prefill rows' offset by it)."""
    return _ACTIVE["tokens"]


def step_cached(key, build):
    """``build()`` once per step and ``key`` (what several layers of the step share, e.g. the CPU
    override's padded layout per window)."""
    cache = _ACTIVE["cache"]
    if key not in cache:
        cache[key] = build()
    return cache[key]


def note_layer_written(layer: object) -> None:
    """An attention override wrote this layer's K/V (vLLM's ``Attention`` module) for the step's rows, tree
    rows at sequential slots; a no-op in a step without trees. Both overrides call it after the stock write."""
    if _ACTIVE["trees"]:
        _ACTIVE["written"].add(getattr(layer, "layer_name", None) or str(id(layer)))


def note_full_graph() -> None:
    """This step of trees (chains only) replays a full CUDA graph (``worker/graphs.py``): every layer's stock KV
    write is in the graph, and no hook runs to record it."""
    if _ACTIVE["trees"]:
        if _ACTIVE["masked"]:
            raise RuntimeError("a step with a branching tree was dispatched to a full CUDA graph: its tree rows' "
                               "attention would not be recomputed")
        _ACTIVE["full_graph"] = True


def full_graph_step() -> bool:
    """Whether this step's trees replayed a full CUDA graph (:func:`note_full_graph`)."""
    return bool(_ACTIVE["full_graph"])


def layers_written() -> set[str]:
    """Names of the layers whose K/V write ran in this step (empty without trees)."""
    return set(_ACTIVE["written"])


def active_trees() -> list[TreeRows] | None:
    """Every tree of the step (the decision, compaction and hand-off need them all)."""
    return _ACTIVE["trees"]


def masked_trees() -> list[TreeRows] | None:
    """The trees whose rows the attention overrides recompute: every tree but the chains
    (``VLLM_HYCO_CHAIN_ATTN=stock``, the default), whose rows vLLM's own attention gets right; a step of
    chains alone (the cut often keeps just the MTP chain at low load) pays no tree attention at all."""
    return _ACTIVE["masked"]


def active_step() -> TreeStep | None:
    """The :class:`TreeStep` of :func:`masked_trees`, on the runner's device."""
    if _ACTIVE["step"] is None and _ACTIVE["masked"]:
        _ACTIVE["step"] = TreeStep.build(_ACTIVE["masked"], _ACTIVE["device"])
    return _ACTIVE["step"]
