"""Running the ranks' programs together (:mod:`.executor`): the scheduler that runs each rank's nodes as their
inputs arrive, the point-to-point messages and collectives between the ranks with MindSpore's semantics, and the
communication counts."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_deepseek.verification.execute.executor import (
    COLLECTIVES,
    MONAD,
    ExecutionError,
    Kernels,
    Node,
    RankProgram,
    python_value,
)


# --------------------------------------------------------------------------------- collectives
@dataclass
class Request:
    """What a rank asks of the others at a communication node."""

    rank: int
    node: Node
    value: Optional[np.ndarray]  # the input (None for Receive)
    group: Tuple[int, ...]  # world ranks of the group, in group order


@dataclass
class CommStats:
    count: int = 0
    bytes: int = 0


@dataclass
class RankStats:
    operators: int = 0
    comm: Dict[Tuple[str, Tuple[int, ...]], CommStats] = field(default_factory=lambda: defaultdict(CommStats))


def group_of(node: Node, world: int) -> Tuple[int, ...]:
    ids = node.attrs.get("group_rank_ids")
    if ids:
        return tuple(int(i) for i in ids)
    ranks = node.attrs.get("group_ranks")
    if isinstance(ranks, str) and ranks and ranks != "WORLD_GROUP":
        return tuple(int(i) for i in ranks.split("-"))
    return tuple(range(world))


_REDUCTIONS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def _reduce(node: Node, values: List[np.ndarray]) -> np.ndarray:
    op = node.attrs.get("op", "sum")
    reduce = _REDUCTIONS.get(op)
    if reduce is None:
        raise ExecutionError(f"{node.op} with op {op!r} at {node.scope or node.output}: not supported")
    total = values[0].copy()
    for v in values[1:]:
        total = reduce(total, v)
    return total


def _collective(kind: str, node: Node, values: List[np.ndarray]) -> List[np.ndarray]:
    """MindSpore's semantics (``mindspore/ops/operations/comm_ops.py`` docstrings): the group's inputs in group
    order -> each member's output. The members' attributes agree (:func:`_check_agree`), so the first's serve."""
    n = len(values)
    if kind == "AllReduce":
        return [_reduce(node, values)] * n
    if kind in ("AllGather", "_MicroStepAllGather"):
        return [np.concatenate(values, axis=0)] * n
    if kind == "ReduceScatter":
        return list(np.split(_reduce(node, values), n, axis=0))
    if kind == "AlltoAll":
        split, concat = int(node.attrs["split_dim"]), int(node.attrs["concat_dim"])
        count = int(node.attrs.get("split_count", n))
        if count != n:  # comm_ops.AlltoAll: split_count must equal the group's size
            raise ExecutionError(f"AlltoAll at {node.scope or node.output}: split_count {count} over a group of {n}")
        chunks = [np.split(v, n, axis=split) for v in values]
        return [np.concatenate([chunks[i][j] for i in range(n)], axis=concat) for j in range(n)]
    if kind == "Broadcast":
        root = int(node.attrs.get("root_rank", 0))
        return [values[root]] * n
    raise ExecutionError(f"collective {kind}: not supported")


# ------------------------------------------------------------------------------------- running
def _compute(program: RankProgram, node: Node, raw: list, kernels: Kernels):
    """One computing node's output from its evaluated inputs."""
    from mindspore import Tensor

    op = node.op
    if op == "Load":  # the parameter's value now (a copy: a later in-place update must not change it)
        return Tensor(raw[0].asnumpy()) if isinstance(raw[0], Tensor) else raw[0]
    if op == "Depend":
        return raw[0]
    if op == "UpdateState":
        return MONAD
    if op == "MakeTuple":
        return tuple(raw)
    if op == "TupleGetItem":
        return raw[0][int(python_value(raw[1]))]
    args = [a for a in raw if a is not MONAD]
    where = node.scope or node.output
    try:
        return kernels.call(node, args)
    except ExecutionError as exc:
        raise ExecutionError(f"rank {program.rank}: {exc}") from None
    except Exception as exc:  # MindSpore's kernel refused the inputs: name the node
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "unregistered" in first:  # pyboost_utils.cc SelectKernel: "The kernel <op> unregistered."
            raise ExecutionError(
                f"rank {program.rank}: {node.op} at {where}: no MindSpore CPU kernel and no stand-in in verification.execute.standins"
            ) from None
        shapes = [tuple(a.shape) if isinstance(a, Tensor) else a for a in args][:6]
        raise ExecutionError(f"rank {program.rank}: {node.op} at {where} failed on inputs {shapes}: {first}") from None


class _Rank:
    """One rank's execution state: its values, the nodes not yet run, and the order its communication must keep.

    A rank runs like a device with communication streams: a node runs once its inputs exist (the graph's data
    and monad edges carry every ordering MindSpore keeps), so a ``Receive`` that waits does not stop the nodes
    that do not need it (a 1F1B stage sends its next forward while the previous backward's gradient is on its
    way). Collectives of one group, and point-to-point messages of one peer and tag, keep the program's order,
    as HCCL pairs them by issue order."""

    def __init__(self, program: RankProgram, env: Dict[str, object], stats: RankStats):
        self.program, self.env, self.stats = program, env, stats
        self.pending: List[Node] = list(program.nodes)
        self.posted: Dict[int, "Request"] = {}  # id(node) -> its request, while it waits
        # per group: the collectives in program order; the next one is the only one this rank may post
        self.next_of_group: Dict[Tuple[int, ...], List[int]] = defaultdict(list)

    def value(self, name: str):
        if name in self.env:
            return self.env[name]
        return self.program.constants[name]

    def ready(self, node: Node) -> bool:
        return all(i in self.env or i in self.program.constants for i in node.inputs)


def run_ranks(
    programs: Sequence[RankProgram],
    envs: Sequence[Dict[str, object]],
    world: int,
    kernels: Optional[Kernels] = None,
    stats: Optional[Dict[int, RankStats]] = None,
) -> Dict[int, object]:
    """Run every rank's program once (one training step); returns rank -> the program's output. ``envs``: per
    rank, the graph's inputs and parameters by their graph names (Parameters for the parameters); each rank's
    computed values are added to its env."""
    import mindspore as ms

    ms.runtime.launch_blocking()  # a kernel's error belongs to its node, not to a later host read
    stats = stats if stats is not None else {}
    ranks: Dict[int, _Rank] = {}
    for program, env in zip(programs, envs):
        stats.setdefault(program.rank, RankStats())
        ranks[program.rank] = _Rank(program, env, stats[program.rank])
        for node in program.nodes:
            if node.op in COLLECTIVES:
                ranks[program.rank].next_of_group[group_of(node, world)].append(id(node))
    scheduler = _Scheduler(ranks, world, kernels or Kernels())
    while any(r.pending for r in ranks.values()):
        progressed = False
        for rank in ranks.values():
            progressed = scheduler.advance(rank) or progressed
        progressed = scheduler.complete_collectives() or progressed
        if not progressed:
            raise ExecutionError(scheduler.deadlock())
    return {r: rank.env[rank.program.output] for r, rank in ranks.items()}


_RAN, _POSTED, _WAIT = "ran", "posted", "wait"  # what a pass did with a ready node


class _Scheduler:
    """The communication between the ranks of :func:`run_ranks`: point-to-point queues, the collectives each
    group's members have posted, and how many each rank has posted per group."""

    def __init__(self, ranks: Dict[int, _Rank], world: int, kernels: Kernels):
        self.ranks, self.world, self.kernels = ranks, world, kernels
        self.messages: Dict[Tuple[int, int, int], List[np.ndarray]] = defaultdict(list)  # (src, dst, tag) -> queue
        self.arrivals: Dict[Tuple[Tuple[int, ...], int], Dict[int, Request]] = {}
        self.issued: Dict[Tuple[int, Tuple[int, ...]], int] = defaultdict(int)  # (rank, group) -> collectives posted

    @staticmethod
    def finish(rank: _Rank, node: Node, out) -> None:
        rank.env[node.output] = out
        rank.stats.operators += 1

    def advance(self, rank: _Rank) -> bool:
        """One pass over the rank's pending nodes: each that can run runs (or posts its collective); True when
        anything happened."""
        progressed = False
        still: List[Node] = []
        for node in rank.pending:
            if node.output in rank.env:  # a collective completed since the last pass
                progressed = True
                continue
            if id(node) in rank.posted or not rank.ready(node):
                still.append(node)
                continue
            outcome = self._run(rank, node)
            if outcome != _RAN:  # a posted collective stays pending until its group completes it
                still.append(node)
            progressed = progressed or outcome != _WAIT
        rank.pending = still
        return progressed

    def _run(self, rank: _Rank, node: Node) -> str:
        """Run a ready node: ``_RAN``; a collective is posted (``_POSTED``); ``_WAIT`` when it must wait (an
        earlier collective of its group, a message not yet sent)."""
        from mindspore import Tensor

        op, world = node.op, self.world
        if op in COLLECTIVES:
            return self._post(rank, node)
        if op == "Send":
            req = _request(rank, node, world)
            # dest_rank / src_rank index the primitive's group (the world group under a pipeline)
            dst = group_of(node, world)[int(node.attrs.get("dest_rank", 0))]
            self.messages[(rank.program.rank, dst, int(node.attrs.get("sr_tag", 0)))].append(req.value)
            _count(rank, node, world, req.value)
            self.finish(rank, node, None)
        elif op == "Receive":
            src = group_of(node, world)[int(node.attrs.get("src_rank", 0))]
            tag = int(node.attrs.get("sr_tag", 0))
            queue = self.messages.get((src, rank.program.rank, tag))
            if not queue:
                return _WAIT
            message = Tensor(queue.pop(0))
            _check_message(node, message, src, rank.program.rank, tag)
            _count(rank, node, world, None)
            self.finish(rank, node, message)
        else:
            self.finish(rank, node, _compute(rank.program, node, [rank.value(i) for i in node.inputs], self.kernels))
        return _RAN

    def _post(self, rank: _Rank, node: Node) -> str:
        """Post a collective (it stays pending until its group completes it); ``_WAIT`` while an earlier
        collective of its group comes first."""
        group = group_of(node, self.world)
        if rank.next_of_group[group][0] != id(node):
            return _WAIT
        rank.next_of_group[group].pop(0)
        req = _request(rank, node, self.world)
        key = (group, self.issued[(rank.program.rank, group)])
        self.issued[(rank.program.rank, group)] += 1
        self.arrivals.setdefault(key, {})[rank.program.rank] = req
        rank.posted[id(node)] = req
        return _POSTED

    def complete_collectives(self) -> bool:
        """Every collective all of whose group's members have posted it: checked, computed, delivered."""
        from mindspore import Tensor

        progressed = False
        for key in [k for k, v in self.arrivals.items() if set(v) == set(k[0])]:
            members = self.arrivals.pop(key)
            _check_agree(members)
            group = key[0]
            first = members[group[0]].node
            outputs = _collective(first.op, first, [members[r].value for r in group])
            for r, out in zip(group, outputs):
                req = members[r]
                rank = self.ranks[r]
                del rank.posted[id(req.node)]
                _count(rank, req.node, self.world, req.value)
                self.finish(rank, req.node, Tensor(out))
            progressed = True
        return progressed

    def deadlock(self) -> str:
        ranks = self.ranks.values()
        waiting = {
            r.program.rank: next(iter(r.posted.values()), None) or _request(r, r.pending[0], self.world, value=False)
            for r in ranks
            if r.pending
        }
        done = [r.program.rank for r in ranks if not r.pending]
        return _deadlock(waiting, done)


def _request(rank: _Rank, node: Node, world: int, value: bool = True) -> Request:
    from mindspore import Tensor

    args = [rank.value(i) for i in node.inputs if i in rank.env or i in rank.program.constants] if value else []
    args = [a for a in args if a is not MONAD]
    x = args[0].asnumpy() if args and isinstance(args[0], Tensor) else None
    return Request(rank.program.rank, node, x, group_of(node, world))


def _count(rank: _Rank, node: Node, world: int, value: Optional[np.ndarray]) -> None:
    entry = rank.stats.comm[(node.op, group_of(node, world))]
    entry.count += 1
    entry.bytes += 0 if value is None else value.nbytes


def _check_message(node: Node, message, src: int, dst: int, tag: int) -> None:
    """A received message against the ``shape`` and ``dtype`` its ``Receive`` declares (``comm_ops.Receive(sr_tag,
    src_rank, shape, dtype, group)``: the receiver allocates that buffer, HCCL fills it with the sender's bytes)."""
    where = node.scope or node.output
    for name in ("shape", "dtype"):
        if name not in node.attrs:
            raise ExecutionError(f"Receive at {where} (rank {dst} from rank {src}, tag {tag}): no {name} attribute")
    shape, dtype = tuple(int(d) for d in node.attrs["shape"]), node.attrs["dtype"]
    if tuple(message.shape) != shape or message.dtype != dtype:
        raise ExecutionError(
            f"rank {dst} received from rank {src} with tag {tag} at {where}: declared {list(shape)} {dtype}, got "
            f"{list(message.shape)} {message.dtype}"
        )


def _fields(req: Request) -> Dict[str, object]:
    """What the members of one collective must agree on, in the order a disagreement is reported."""
    node = req.node
    fields: Dict[str, object] = {"kind": node.op, "group": list(req.group)}
    if node.op in ("AllReduce", "ReduceScatter"):
        fields["op"] = node.attrs.get("op", "sum")
    if node.op == "AlltoAll":
        for name in ("split_dim", "concat_dim", "split_count"):
            fields[name] = node.attrs.get(name)
    if node.op == "Broadcast":
        fields["root_rank"] = node.attrs.get("root_rank", 0)
    fields["shape"] = None if req.value is None else list(req.value.shape)
    fields["dtype"] = None if req.value is None else str(req.value.dtype)
    return fields


def _check_agree(members: Dict[int, Request]) -> None:
    """The members of one collective (the group's n-th on each) agree on its kind, group, attributes, and their
    inputs' shape and dtype (every member's input alike, AlltoAll's too: HCCL's all-to-all sends equal blocks)."""
    ranks = sorted(members)
    first = members[ranks[0]]
    want = _fields(first)
    for r in ranks[1:]:
        other = members[r]
        got = _fields(other)
        for name, value in want.items():
            if got.get(name) != value:
                raise ExecutionError(
                    f"ranks {ranks[0]} and {r} disagree on the {name} of their collective over group {ranks}: "
                    f"rank {ranks[0]} {value} ({first.node.op} {_desc(first.value)} at "
                    f"{first.node.scope or first.node.output}), rank {r} {got.get(name)} ({other.node.op} "
                    f"{_desc(other.value)} at {other.node.scope or other.node.output})"
                )


def _desc(value: Optional[np.ndarray]) -> str:
    return "" if value is None else f"{list(value.shape)} {value.dtype}"


def _deadlock(waiting: Dict[int, Request], done: List[int]) -> str:
    text = "; ".join(
        f"rank {r} at {req.node.op} over {list(req.group)} ({req.node.scope or req.node.output})"
        for r, req in sorted(waiting.items())
    )
    return f"deadlock: {text}" + (f"; finished: ranks {sorted(done)}" if done else "")
