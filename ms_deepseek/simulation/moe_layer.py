"""CPU simulation of one sharded MoE layer: every virtual rank runs its share, the AllToAll is emulated.

:func:`simulate_moe_layer` takes an MoE layer that :func:`ms_deepseek.parallel_apply.apply.apply_plan`
has prepared (token groups G = dp, exchange view ep, placement, strategies on the primitives)
and runs, in PyNative on this CPU, what each device of one pipeline stage would run under
SEMI_AUTO_PARALLEL (``ms_deepseek/model/moe.py`` says which pattern and why):

1. data-parallel rank d (the token groups the ``dispatch_gather`` strategy gives it):
   routing, ExpertLookup and the dispatch gather on its own tokens (``layer.dispatch``);
2. the dp -> ep AllToAll, emulated from the ``to_experts`` strategy: the buffer view
   [G/ep, ep, E, C, H] arrives split (dp/ep, ep) over the dp ranks, so rank d = u*ep + j
   (:mod:`ms_deepseek.parallel_plan.ranks`: ep the inner factor, block j = d % ep) holds view block
   [u, j]; the transpose reads it split (dp/ep, 1, ep), so device u*ep + a collects experts
   block a from the ranks u*ep + j', j' in ep: the exchange group is ep adjacent dp ranks;
3. each expert device: the slice the ``experts.*_bmm`` strategies give it (the 4-D input
   [G/ep, E, ep*C, H] split (dp/ep, ep, 1, 1), the expert intermediate size by tp); it must be
   exactly what the exchange delivered (else the plan is reported broken); the down
   projection's partial sums over the tp slices are added (the all-reduce);
4. the AllToAll back (``from_experts``) and the combine gather on each rank's tokens.

The whole per-rank program is one differentiable function of the tokens and the stacked
expert weights, so ``ms.value_and_grad`` gives the backward of every per-rank piece (the
gradient of an emulated AllToAll is the reverse exchange). It is compared with the
unsharded layer (the same G groups, so the same per-rank capacity), forward and backward.

Not simulated here (not ours, or handled by MindSpore's own rules): the balance losses'
reductions, the shared experts' tensor parallelism (run whole per rank), LoRA adapters.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from ms_deepseek.parallel_plan.ranks import expert_block_of_dp_rank

SIM_ERROR = float("inf")


class PlanMismatch(ValueError):
    """The plan's strategies do not describe a sharding the layer can run (reported, not raised)."""


def _strategy(prim, fallback):
    got = prim.attrs.get("in_strategy") if hasattr(prim, "attrs") else None
    return tuple(tuple(int(k) for k in s) for s in got) if got else fallback


def _layout(layer, mesh) -> Dict[str, object]:
    """The split of every stage of the dispatch, read from the layer's primitives (apply_plan's
    strategies) or, for a layer the plan was never applied to, nothing split."""
    E, G = layer.num_experts, layer.groups
    disp = _strategy(layer.dispatch_gather, ((1, 1, 1), (1, 1, 1)))
    exch = _strategy(layer.to_experts, ((1, 1, 1, 1, 1),))[0]
    back = _strategy(layer.from_experts, ((1, 1, 1, 1, 1),))[0]
    comb = _strategy(layer.combine_gather, ((1, 1, 1), (1, 1, 1)))
    gate = _strategy(layer.experts.gate_bmm, ((1, 1, 1, 1), (1, 1, 1)))
    up = _strategy(layer.experts.up_bmm, ((1, 1, 1, 1), (1, 1, 1)))
    down = _strategy(layer.experts.down_bmm, ((1, 1, 1, 1), (1, 1, 1)))
    ranks = disp[0][0]
    problems: List[str] = []
    if disp[1][0] != ranks or comb[0][0] != ranks or comb[1][0] != ranks:
        problems.append(f"dispatch/combine gathers split the groups differently: {disp}, {comb}")
    if any(k != 1 for s in disp + comb for k in s[1:]):
        problems.append(f"dispatch/combine gathers split a non-batch axis: {disp}, {comb}")
    if G != ranks or ranks != mesh.dp:
        problems.append(
            f"dispatch_gather splits the {G} token groups {ranks} ways, not one group per each of "
            f"the {mesh.dp} data-parallel ranks"
        )
    outer_x, ep_x = exch[0], exch[2] if len(exch) == 5 else 0
    if exch != back or len(exch) != 5 or exch[1] != 1 or any(k != 1 for k in exch[3:]) or outer_x * ep_x != ranks:
        problems.append(
            f"to_experts/from_experts {exch}/{back} do not split the exchange view [G/ep, ep, E, C, H] "
            f"as (dp/ep, 1, ep, 1, 1) = ({ranks // max(layer.ep, 1)}, 1, {layer.ep}, 1, 1)"
        )
    elif ep_x != layer.ep:
        problems.append(f"to_experts splits the experts {ep_x} ways but the layer's ep is {layer.ep}")
    if len(gate[0]) != 4 or len(down[0]) != 4 or len(gate[1]) != 3 or len(down[1]) != 3:
        problems.append(
            f"the expert matmuls {gate} / {down} do not split a 4-D input [G/ep, E, ep*C, H] and "
            f"3-D weights [E, out, in]"
        )
        return {"ranks": ranks, "problems": problems}
    (outer_b, ep_b, _, _), (ep_w, tp_w, _) = gate
    if up != gate:
        problems.append(f"up_bmm {up} differs from gate_bmm {gate}")
    if down[0][:2] != (outer_b, ep_b) or down[1][0] != ep_w or down[0][3] != tp_w or down[1][2] != tp_w:
        problems.append(f"down_bmm {down} does not match gate_bmm {gate} (experts and tp split alike)")
    if ep_b != ep_w:
        problems.append(f"the expert matmuls split the tokens' experts {ep_b} ways but the weights {ep_w} ways")
    if gate[0][2:] != (1, 1) or down[0][2] != 1:
        problems.append(f"the expert matmuls split the token rows of an expert: {gate} / {down}")
    if E % max(ep_b, 1) or E % max(ep_x, 1):
        problems.append(f"{E} experts do not split {ep_b} / {ep_x} ways")
    if (outer_b, ep_b) != (outer_x, ep_x):
        problems.append(
            f"the expert matmuls' device grid ({outer_b} x {ep_b}) is not the exchange's "
            f"({outer_x} x {ep_x}) over the {ranks} dp ranks"
        )
    return {"ranks": ranks, "outer": outer_x, "ep_x": ep_x, "ep_b": ep_b, "tp": tp_w, "problems": problems}


def _slices(n: int, parts: int, index: int) -> slice:
    size = n // parts
    return slice(index * size, (index + 1) * size)


def _dp_to_ep(buffers, outer: int, ep_x: int, Ex: int, ch, view_block):
    """The emulated dp -> ep AllToAll: ({device: its [Ex, ep*C, H] block}, {device: the dp ranks it gathers
    from, in order})."""
    from mindspore import ops

    C, H = ch
    R = len(buffers)
    received, members = {}, {}
    for u in range(outer):
        for a in range(ep_x):
            src = [d for d in range(R) if view_block(d)[0] == u]
            src.sort(key=lambda d: view_block(d)[1])
            members[u * ep_x + a] = src
            parts = [buffers[d][0, a * Ex : (a + 1) * Ex] for d in src]  # ep x [Ex, C, H]
            # [ep, Ex, C, H] -> [Ex, ep, C, H] -> [Ex, ep*C, H]: device (u, a)'s block of [G/ep, E, ep*C, H]
            received[u * ep_x + a] = ops.stack(parts, 0).transpose(1, 0, 2, 3).reshape(Ex, ep_x * C, H)
    return received, members


def _expert_device(h, e_sl, weights, tp: int, cdt):
    """One expert device's SwiGLU experts on its received rows ``h`` [Eb, ep*C, H]: the tp slices of the
    expert intermediate size, down's partial sums all-reduced."""
    from mindspore import ops

    bmm = ops.BatchMatMul(transpose_b=True)
    wg, wu, wd = weights
    I = wg.shape[1]
    partial = None
    for t in range(tp):
        i_sl = _slices(I, tp, t)
        gate = bmm(h, wg[e_sl, i_sl].astype(cdt))  # [Eb, ep*C, I/tp]
        upv = bmm(h, wu[e_sl, i_sl].astype(cdt))  # [Eb, ep*C, I/tp]
        o = bmm(ops.silu(gate) * upv, wd[e_sl, :, i_sl].astype(cdt))  # [Eb, ep*C, H]
        partial = o if partial is None else partial + o
    return partial


def _sharded_forward(layer, lay, x, wg, wu, wd):
    """The per-rank program: x [B, T, H] and the stacked expert weights -> y [B, T, H] (routed + shared)."""
    from mindspore import ops

    B, T, H = x.shape
    E, G = layer.num_experts, layer.groups
    N = B * T // G
    C = layer.capacity(N)
    R, outer, ep_x, ep_b, tp = lay["ranks"], lay["outer"], lay["ep_x"], lay["ep_b"], lay["tp"]
    tokens = x.reshape(G, N, H)  # [B, T, H] -> [G, N, H]: rank-major rows, one group per rank (G = R)
    cdt = layer.experts.compute_dtype

    def view_block(d):
        # (u, j) of data-parallel rank d in the view [G/ep, ep, ...] (the rule the model and plan use)
        return d // ep_x, expert_block_of_dp_rank(d, ep_x)

    # 1. each data-parallel rank: routing, lookup and dispatch on its own group
    buffers, routes = [], []
    for d in range(R):
        buf, route = layer.dispatch(tokens[d : d + 1])  # [1, E, C, H]
        buffers.append(buf)
        routes.append(route)

    # 2. emulated dp -> ep AllToAll: device u*ep + a collects experts block a of view row u, i.e. from the
    #    ranks d with view_block(d) = (u, j), j in ep, in j order (the transpose's (dp/ep, 1, ep) split).
    Ex = E // ep_x
    received, members = _dp_to_ep(buffers, outer, ep_x, Ex, (C, H), view_block)
    lay["exchange_groups"] = sorted({tuple(m) for m in members.values()})  # the AllToAll groups (dp ranks)

    # 3. each expert device: the slice its matmul strategy says, which must be what it received
    Eb = E // ep_b
    outputs = {}
    I = wg.shape[1]
    if I % tp:
        raise PlanMismatch(f"the expert intermediate size {I} does not split {tp} ways")
    for dev in range(R):
        u, a = dev // ep_b, dev % ep_b  # the matmuls' device matrix (dp/ep, ep, ..., tp), tp apart
        got = received[dev]
        if tuple(got.shape) != (Eb, ep_x * C, H):
            raise PlanMismatch(
                f"device {dev}: the AllToAll delivers {tuple(got.shape)} but the expert matmul "
                f"strategy expects [1, {Eb}, {ep_x * C}, {H}]"
            )
        outputs[dev] = _expert_device(got.astype(cdt), _slices(E, ep_b, a), (wg, wu, wd), tp, cdt).astype(x.dtype)

    # 4. emulated ep -> dp AllToAll back and the combine on each rank's tokens
    ys = []
    for d in range(R):
        u, j = view_block(d)
        blocks = []
        for a in range(ep_x):  # experts block a of rank d's group, from the device (u, a)
            if d not in members[u * ep_x + a]:
                raise PlanMismatch(f"rank {d} is not in the exchange group of device {u * ep_x + a}")
            blocks.append(outputs[u * ep_x + a].reshape(Ex, ep_x, C, H)[:, j])  # [Ex, C, H]
        back = ops.concat(blocks, 0).reshape(1, E * C, H)  # [E, C, H] -> [1, E*C, H]
        ys.append(layer.combine(back, routes[d]))  # [1, N, H] float32
    y = ops.concat(ys, 0).astype(x.dtype).reshape(B, T, H)  # [G, N, H] -> [B, T, H]
    if layer.shared_experts is not None:
        y = y + layer.shared_experts(x)
    return y


def simulate_moe_layer(layer, x, mesh) -> Dict[str, object]:
    """Run one MoE layer as its sharded ranks would, on this CPU, and compare with the unsharded layer.

    ``layer``: a ``DeepseekV2MoE`` the plan was applied to (``apply_plan``: groups, ep, placement and the
    primitives' strategies); ``x``: float32 ``[B, T, H]`` with ``B * T`` divisible by ``layer.groups``;
    ``mesh``: the plan's ``Mesh`` (``dp``, ``tp``, ``ep``). The layer runs in training mode (the capacity
    factor applies, per data-parallel group) in PyNative; the previous mode is restored.

    Returns a dict: ``forward_max_err`` (max |y_sharded - y_unsharded|), ``backward_max_err`` (max abs
    difference of the gradients of x and of the stacked expert weights, for a fixed random cotangent),
    ``ranks``, ``capacity``, ``dropped``, ``exchange_groups`` (the data-parallel ranks of each emulated
    AllToAll, e.g. ``[[0, 1], [2, 3]]`` for dp 4 ep 2: adjacent ranks) and ``problem`` (None, or why the plan's strategies cannot run:
    then both errors are ``inf``).
    """
    import mindspore as ms

    report: Dict[str, object] = {"forward_max_err": SIM_ERROR, "backward_max_err": SIM_ERROR, "problem": None}
    lay = _layout(layer, mesh)
    B, T, H = x.shape
    G = layer.groups
    report["ranks"] = lay["ranks"]
    if (B * T) % G:
        lay["problems"].append(f"{B}x{T} tokens do not split into {G} groups")
    if lay["problems"]:
        report["problem"] = "; ".join(lay["problems"])
        return report

    old_mode, was_training = ms.get_context("mode"), layer.training
    ms.set_context(mode=ms.PYNATIVE_MODE)
    layer.set_train(True)
    try:
        report["capacity"] = layer.capacity(B * T // G)
        report["forward_max_err"], report["backward_max_err"] = _compare(layer, lay, x)
        keep = layer.dispatch(x.reshape(G, B * T // G, H))[1][5].asnumpy()
        report["dropped"] = float(1.0 - keep.mean())
        report["exchange_groups"] = [list(g) for g in lay["exchange_groups"]]
    except PlanMismatch as exc:
        report["problem"] = str(exc)
    finally:
        layer.set_train(was_training)
        ms.set_context(mode=old_mode)
    return report


def _compare(layer, lay, x) -> Tuple[float, float]:
    """(max forward difference, max gradient difference) of the emulated sharded layer against the layer
    itself, the gradients of x and of the stacked expert weights for a fixed random cotangent."""
    import mindspore as ms
    from mindspore import Tensor

    experts = layer.experts
    weights = [experts.gate_proj.weight, experts.up_proj.weight, experts.down_proj.weight]
    rng = np.random.default_rng(0)
    cot = Tensor(rng.standard_normal(tuple(x.shape)).astype(np.float32))

    def unsharded(xx):
        return (layer(xx)[0].astype(ms.float32) * cot).sum()

    loss_ref, (gx_ref, gw_ref) = ms.value_and_grad(unsharded, 0, weights)(x)
    y_ref = layer(x)[0]

    w_values = [Tensor(w.asnumpy()) for w in weights]

    def sharded(xx, wg, wu, wd):
        return (_sharded_forward(layer, lay, xx, wg, wu, wd).astype(ms.float32) * cot).sum()

    y_sim = _sharded_forward(layer, lay, x, *w_values)
    _, grads = ms.value_and_grad(sharded, (0, 1, 2, 3))(x, *w_values)
    pairs = [(grads[0], gx_ref)] + list(zip(grads[1:], gw_ref))
    return (
        float(np.abs(y_sim.asnumpy() - y_ref.asnumpy()).max()),
        float(max(np.abs(a.asnumpy() - b.asnumpy()).max() for a, b in pairs)),
    )
