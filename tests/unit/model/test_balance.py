"""Auxiliary-loss-free expert balancing and the sequence-wise aux loss (dsflow.model.balance)."""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import tiny_v2
from dsflow.model.balance import ExpertBalancer, aggregate_stats, from_params, load_stats
from dsflow.model.build import build_model
from dsflow.model.presets import model_config

V, T, B = 2048, 128, 8


def _tiny(seed=0, vocab=V, **overrides):
    torch.manual_seed(seed)
    return build_model(model_config("tiny", vocab, overrides or None), device_type="cpu")


def _chain_batch(gen, perm, batch=B, seq=T):
    """Deterministic bigram data (x[t+1] = perm[x[t]]): learnable, and it keeps the hidden
    states token-specific (uniform random tokens make them collapse to a constant)."""
    x = torch.empty(batch, seq, dtype=torch.long)
    x[:, 0] = torch.randint(0, perm.numel(), (batch,), generator=gen)
    for t in range(1, seq):
        x[:, t] = perm[x[:, t - 1]]
    return x


# --------------------------------------------------------------------------- stats math


def test_stats_uniform_and_one_hot():
    uniform = load_stats([10, 10, 10, 10])
    assert uniform["max_over_mean"] == pytest.approx(1.0)
    assert uniform["entropy"] == pytest.approx(1.0)
    assert uniform["load"] == [10, 10, 10, 10] and uniform["tokens"] == 40
    one_hot = load_stats(torch.tensor([0, 12, 0, 0]))
    assert one_hot["max_over_mean"] == pytest.approx(4.0)
    assert one_hot["entropy"] == pytest.approx(0.0)
    half = load_stats([5, 5, 0, 0])
    assert half["max_over_mean"] == pytest.approx(2.0)
    assert half["entropy"] == pytest.approx(math.log(2) / math.log(4))
    empty = load_stats([0, 0, 0])
    assert empty["max_over_mean"] is None and empty["entropy"] is None


def test_aggregate_over_layers():
    agg = aggregate_stats({1: load_stats([1, 1]), 2: load_stats([2, 0]), 3: load_stats([0, 0])})
    assert agg["max_over_mean"] == pytest.approx(1.5)  # mean of 1.0 and 2.0; empty layer skipped
    assert agg["max_over_mean_worst"] == pytest.approx(2.0)
    assert agg["entropy_min"] == pytest.approx(0.0)
    assert agg["entropy_mean"] == pytest.approx(0.5)
    assert set(agg["layers"]) == {1, 2, 3}


# --------------------------------------------------------------------------- hooks and updates


def test_finds_moe_layers_and_counts_topk_in_training_only():
    model = _tiny(vocab=256)
    bal = ExpertBalancer(model, gamma=0.0)
    assert bal.layers == [1, 2, 3] and bal.n_experts == 8
    ids = torch.randint(0, 256, (2, 32))
    model.eval()
    with torch.no_grad():
        model(ids)
    assert int(bal.counts().sum()) == 0  # eval: not counted
    model.train()
    model(ids)
    model(ids)  # two micro-batches accumulate
    counts = bal.counts()
    assert counts.dtype == torch.int64
    assert counts.sum(-1).tolist() == [2 * 2 * 32 * 2] * 3  # micro-batches x tokens x top-2
    stats = bal.update()
    assert [s["tokens"] for s in stats["layers"].values()] == [256, 256, 256]
    assert int(bal.counts().sum()) == 0  # reset after update


def test_counts_are_each_layers_top_k_choices_per_expert():
    """The hook's counting (sync-free on CUDA, unlike torch.bincount) gives bincount's counts."""
    model = _tiny(vocab=256).train()
    bal = ExpertBalancer(model, gamma=0.0)
    chosen = {i: [] for i in range(len(bal.routers))}
    for i, (_, router) in enumerate(bal.routers):
        router.register_forward_hook(lambda m, a, out, i=i: chosen[i].append(out[2].reshape(-1)))
    for seed in range(3):
        model(torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed)))
    counts = bal.counts()
    for i, picks in chosen.items():
        expected = torch.bincount(torch.cat(picks), minlength=bal.n_experts)
        assert torch.equal(counts[i], expected), i
    assert len(set(map(tuple, counts.tolist()))) > 1  # the layers route differently


def test_collecting_counts_in_eval_separately():
    model = _tiny(vocab=256)
    bal = ExpertBalancer(model, gamma=0.5)
    ids = torch.randint(0, 256, (2, 16))
    model.train()
    model(ids)
    model.eval()
    with torch.no_grad(), bal.collecting():
        model(ids)
        model(ids)
    ev = bal.eval_stats()
    assert [s["tokens"] for s in ev["layers"].values()] == [2 * 2 * 16 * 2] * 3
    assert [s["tokens"] for s in bal.update()["layers"].values()] == [2 * 16 * 2] * 3
    assert bal.eval_stats()["max_over_mean"] is None  # reset


def test_traced_hooks_count_collect_and_stash_like_the_eager_ones():
    """The hooks torch.compile may trace (train.perf.compile_router_hooks), run here as plain
    Python: the same training counts, eval counts, aux loss and resets as the eager hooks,
    with two forwards per aux_loss call."""
    results = []
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    for traced in (False, True):
        model = _tiny(vocab=256)
        bal = ExpertBalancer(model, gamma=0.0, seq_aux_alpha=0.01)
        if traced:
            bal.trace_hooks("cpu")
        model.train()
        model(ids)
        model(ids.flip(0))
        aux = bal.aux_loss()
        counts = bal.counts()
        model.eval()
        with torch.no_grad(), bal.collecting():
            model(ids)
        eval_tokens = [s["tokens"] for s in bal.eval_stats()["layers"].values()]
        model.train()
        model(ids)
        bal.reset()
        results.append((aux.detach(), counts, eval_tokens, bal.counts(), bal.aux_loss()))
    (aux_e, counts_e, eval_e, reset_e, left_e), (aux_t, counts_t, eval_t, reset_t, left_t) = results
    torch.testing.assert_close(aux_t, aux_e, rtol=1e-6, atol=0)
    assert aux_e > 0 and torch.equal(counts_t, counts_e)
    assert counts_e.sum() == 3 * 2 * 2 * 16 * 2  # 3 MoE layers, 2 forwards of 2 x 16, top-2
    assert eval_t == eval_e == [2 * 16 * 2] * 3
    assert reset_t.sum() == reset_e.sum() == 0 and left_t.item() == left_e.item() == 0.0
    # Counts re-created elsewhere (another device): the traced hooks add into the new ones.
    moved = bal._buffer("_counts", torch.device("meta"))
    assert all(r._dsflow_counts._base is moved for _, r in bal.routers)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recompute_is_not_counted(reentrant):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    counts, grads = [], []
    for checkpointing in (False, True):
        model = _tiny(vocab=256).train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        bal = ExpertBalancer(model, gamma=0.0, seq_aux_alpha=0.01)
        if checkpointing and reentrant:  # forward under no_grad: no aux loss possible, warned
            with pytest.warns(UserWarning, match="reentrant"):
                out = model(input_ids=ids, labels=ids)
        else:
            out = model(input_ids=ids, labels=ids)
        (out.loss + bal.aux_loss()).backward()
        assert bal._aux == []  # the recomputation stashed nothing
        counts.append(bal.counts())
        grads.append(torch.cat([r.weight.grad.flatten() for _, r in bal.routers]))
    assert torch.equal(counts[0], counts[1])
    if not reentrant:  # the aux loss reaches the routers through the checkpointed layers
        torch.testing.assert_close(grads[0], grads[1])


def test_bias_update_direction():
    model = _tiny(vocab=256).train()
    gamma = 0.05
    bal = ExpertBalancer(model, gamma=gamma)
    routers = [r for _, r in bal.routers]
    with torch.no_grad():
        for r in routers:
            r.e_score_correction_bias[3] = 1.0  # every token picks expert 3: overloaded
    model(torch.randint(0, 256, (2, 32)))
    counts = bal.counts().double()
    stats = bal.update()
    for i, r in enumerate(routers):
        load = counts[i]
        assert load[3] == load.max() == 64  # all 64 tokens
        expected = torch.where(
            load > load.mean(), -gamma, torch.where(load < load.mean(), gamma, 0.0)
        )
        expected[3] += 1.0
        torch.testing.assert_close(r.e_score_correction_bias, expected.float())
        assert r.e_score_correction_bias[3] == pytest.approx(1.0 - gamma)
        assert r.e_score_correction_bias.dtype == torch.float32
    assert stats["max_over_mean"] >= 4.0 - 1e-9  # 1/2 of all assignments on one of 8 experts
    assert stats["bias_abs_max"] == pytest.approx(1.0 - gamma)


def test_update_on_the_device_moves_the_biases_only_where_the_step_was_applied():
    """update_async with `applied` a device flag (the fused optimizer's, decided without a
    host read): true gives update()'s biases and stats, bit for bit; false leaves the biases
    as they were; both reset the counts."""
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    runs = {}
    for applied in ("update", True, False):
        model = _tiny(vocab=256).train()
        bal = ExpertBalancer(model, gamma=0.05)
        before = [r.e_score_correction_bias.clone() for _, r in bal.routers]
        model(tokens)
        if applied == "update":
            stats = bal.update()
        else:
            stats = bal.stats_of(bal.update_async(applied=torch.tensor(applied)))
        assert int(bal.counts().sum()) == 0
        after = [r.e_score_correction_bias.clone() for _, r in bal.routers]
        runs[applied] = (before, after, stats)
    before, plain, stats = runs["update"]
    assert any(not torch.equal(a, b) for a, b in zip(plain, before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], plain, strict=True))
    assert runs[True][2] == stats
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], before, strict=True))
    assert runs[False][2]["max_over_mean"] == stats["max_over_mean"]


def test_gamma_zero_reports_stats_without_moving_bias():
    model = _tiny(vocab=256).train()
    bal = ExpertBalancer(model, gamma=0.0)
    model(torch.randint(0, 256, (2, 32)))
    stats = bal.update()
    assert stats["max_over_mean"] >= 1.0 and 0 < stats["entropy_min"] <= 1.0
    for _, r in bal.routers:
        assert torch.count_nonzero(r.e_score_correction_bias) == 0


def test_bias_upcast_to_fp32_when_model_was_cast():
    model = _tiny(vocab=256).to(torch.bfloat16)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.bfloat16
    bal = ExpertBalancer(model, gamma=1e-3)
    for _, r in bal.routers:
        assert r.e_score_correction_bias.dtype == torch.float32
    model.train()
    model(torch.randint(0, 256, (1, 16)))  # bf16 forward still works with the fp32 bias
    bal.update()


def test_dense_model_is_a_no_op():
    model = _tiny(vocab=256, first_k_dense_replace=4)
    bal = ExpertBalancer(model, gamma=1e-3, seq_aux_alpha=0.1)
    model.train()
    model(torch.randint(0, 256, (1, 8)))
    assert bal.update()["max_over_mean"] is None
    assert float(bal.aux_loss()) == 0.0


# --------------------------------------------------------------------------- sequence-wise aux loss


def _expected_seq_aux(logits, topk, batch, n_exp, k):
    """Eqs. 17-20 of the DeepSeek-V3 paper, written out with loops."""
    scores = logits.sigmoid().view(batch, -1, n_exp)
    seq = scores.shape[1]
    topk = topk.view(batch, seq, k)
    total = 0.0
    for b in range(batch):
        loss_b = 0.0
        for i in range(n_exp):
            f_i = n_exp / (k * seq) * float((topk[b] == i).any(-1).sum())
            p_i = float((scores[b, :, i] / scores[b].sum(-1)).mean())
            loss_b += f_i * p_i
        total += loss_b
    return total / batch


def test_seq_aux_loss_value_grad_and_disabled():
    model = _tiny(vocab=256).train()
    alpha = 0.01
    bal = ExpertBalancer(model, gamma=0.0, seq_aux_alpha=alpha)
    captured = []
    for _, r in bal.routers:
        r.register_forward_hook(lambda m, a, o: captured.append((o[0].detach(), o[2])))
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    aux = bal.aux_loss()
    expected = alpha * sum(_expected_seq_aux(lg, tk, 3, 8, 2) for lg, tk in captured)
    assert aux.item() == pytest.approx(expected, rel=1e-5)
    assert aux.item() > 0
    assert bal.aux_loss().item() == 0.0  # stash cleared
    (out.loss + aux).backward()
    for _, r in bal.routers:
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    # The aux loss alone reaches the router weights.
    model.zero_grad()
    model(ids)
    bal.aux_loss().backward()
    assert all(r.weight.grad.abs().sum() > 0 for _, r in bal.routers)

    model2 = _tiny(vocab=256).train()
    disabled = ExpertBalancer(model2, seq_aux_alpha=0.0)
    model2(ids)
    loss = disabled.aux_loss()
    assert loss.item() == 0.0 and loss.shape == ()


def test_seq_aux_not_stashed_in_eval_or_no_grad():
    model = _tiny(vocab=256)
    bal = ExpertBalancer(model, seq_aux_alpha=0.1)
    ids = torch.randint(0, 256, (2, 8))
    model.eval()
    model(ids)
    model.train()
    with torch.no_grad(), pytest.warns(UserWarning, match="without autograd"):
        model(ids)
    assert bal._aux == [] and bal.aux_loss().item() == 0.0


# --------------------------------------------------------------------------- DeepSeek-V2


def _tiny_v2(seed=0, vocab=256, **overrides):
    torch.manual_seed(seed)
    config = model_config("deepseek-v2-lite", vocab, tiny_v2(**overrides))
    return build_model(config, device_type="cpu")


def _moegate(hidden, weight, cfg, bsz, seq_len):
    """DeepSeek-V2's MoEGate.forward (DeepSeek's modeling_deepseek.py), written out again:
    softmax scores, greedy or group-limited greedy top-k, top-k weights scaled, and the
    expert-level balance loss per sequence (seq_aux) or over the whole batch."""
    import torch.nn.functional as F

    n_exp, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), weight.float())
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if cfg.topk_method == "greedy":
        topk_weight, topk_idx = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    else:
        group_scores = scores.view(bsz * seq_len, cfg.n_group, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(bsz * seq_len, cfg.n_group, n_exp // cfg.n_group)
            .reshape(bsz * seq_len, -1)
        )
        tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_weight, topk_idx = torch.topk(tmp_scores, k=top_k, dim=-1, sorted=False)
    topk_weight = topk_weight * cfg.routed_scaling_factor  # norm_topk_prob is false
    idx = topk_idx.view(bsz, -1)
    if cfg.seq_aux:
        ce = torch.zeros(bsz, n_exp).scatter_add_(1, idx, torch.ones(bsz, seq_len * top_k))
        ce = ce.div_(seq_len * top_k / n_exp)
        aux = (ce * scores.view(bsz, seq_len, -1).mean(dim=1)).sum(dim=1).mean()
    else:
        ce = F.one_hot(idx.view(-1), num_classes=n_exp).float().mean(0)
        aux = (scores.mean(0) * ce * n_exp).sum()
    return topk_idx, topk_weight, aux * cfg.aux_loss_alpha


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"seq_aux": False, "aux_loss_alpha": 0.01},
        {
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 16.0,
        },
    ],
    ids=["greedy-seq", "greedy-batch", "group-limited"],
)
def test_v2_router_and_balance_loss_match_hf_and_deepseeks_gate(overrides):
    """HF's DeepseekV2ForCausalLM routes as DeepSeek's MoEGate; the balancer counts what HF
    routes and adds MoEGate's balance loss (summed over the MoE layers); the training loss
    is HF's own; the aux loss alone reaches every router."""
    from dsflow.model.loss import TrainingLM

    model = _tiny_v2(**overrides).train()
    bal, line = from_params(model, {"gamma": 0.5, "seq_aux_alpha": 0.3, "aux_loss_alpha": "auto"})
    assert bal.seq_aux is model.config.seq_aux and bal.gamma == 0.0
    assert bal.seq_aux_alpha == model.config.aux_loss_alpha
    seen = []
    for _, r in bal.routers:
        r.register_forward_hook(lambda m, a, out: seen.append((m, a[0].detach(), out)))
    ids = _chain_batch(torch.Generator().manual_seed(0), torch.randperm(256), batch=3, seq=21)
    hf_loss = model(input_ids=ids, labels=ids).loss
    aux = bal.aux_loss()
    want = 0.0
    for router, hidden, (_, weights, indices) in seen:
        ref_idx, ref_w, ref_aux = _moegate(hidden, router.weight, model.config, 3, 21)
        assert torch.equal(indices.sort(-1).values, ref_idx.sort(-1).values)
        torch.testing.assert_close(weights.sort(-1).values, ref_w.sort(-1).values)
        want += ref_aux
    torch.testing.assert_close(aux, want, rtol=1e-5, atol=0)
    assert aux > 0
    counts = torch.stack([torch.bincount(o[2].flatten(), minlength=8) for *_, o in seen])
    assert torch.equal(bal.counts(), counts)
    mean = TrainingLM(model)(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(mean, hf_loss, rtol=1e-5, atol=1e-6)
    model.zero_grad()
    bal.aux_loss()  # the TrainingLM forward's stash
    model(ids)
    bal.aux_loss().backward()
    assert all(r.weight.grad.abs().sum() > 0 for _, r in bal.routers)
    assert model.lm_head.weight.grad is None  # the aux loss touches the routers' inputs only


def test_v2_balancer_keeps_stats_and_has_no_bias_to_move_or_save():
    model = _tiny_v2().train()
    bal, line = from_params(model, {"gamma": 0.5, "seq_aux_alpha": 0.3, "aux_loss_alpha": 0.02})
    assert bal.softmax and bal.biases == [] and bal.seq_aux_alpha == 0.02
    assert "deepseek_v2" in line and "alpha 0.02 (train.balance.aux_loss_alpha)" in line
    model(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2)))
    stats = bal.update()
    assert [s["tokens"] for s in stats["layers"].values()] == [2 * 32 * 2] * 3
    assert "bias_abs_max" not in stats and int(bal.counts().sum()) == 0
    assert bal.bias_state() == []
    bal.load_bias_state([])  # a checkpoint of a V2 run
    bal.sync_bias()
    with pytest.raises(ValueError, match="1 router biases for 0 routers"):
        bal.load_bias_state([torch.zeros(8)])
    model.eval()
    with torch.no_grad(), bal.collecting():  # the evaluate stage's statistics
        model(torch.randint(0, 256, (1, 16)))
    assert [s["tokens"] for s in bal.eval_stats()["layers"].values()] == [16 * 2] * 3
    _, line = from_params(_tiny_v2(seq_aux=False), {"gamma": 0.0, "seq_aux_alpha": 0.0})
    assert "batch-wise balance loss, alpha 0.001 (the model config's aux_loss_alpha)" in line
    v3, line = from_params(_tiny(vocab=256), {"gamma": 0.002, "seq_aux_alpha": 0.0003})
    assert (v3.gamma, v3.seq_aux_alpha, v3.softmax, len(v3.biases)) == (0.002, 0.0003, False, 3)
    assert line.startswith("deepseek_v3: aux-loss-free routing bias, gamma 0.002")


def test_zero3_gathers_either_familys_moe_blocks_whole():
    """ZeRO-3's leaf modules: every DeepseekV3MoE and DeepseekV2Moe block is gathered at once."""
    from dsflow.train.engine import _gather_moe_blocks_whole

    for model, name in ((_tiny(vocab=256), "DeepseekV3MoE"), (_tiny_v2(), "DeepseekV2Moe")):
        _gather_moe_blocks_whole(model)
        blocks = [m for m in model.modules() if getattr(m, "_z3_leaf", False)]
        assert [type(m).__name__ for m in blocks] == [name] * 3


# --------------------------------------------------------------------------- training runs


def _train(gamma, *, collapse=False, boost=0.0, steps=40, seed=0):
    """Train the tiny MoE for ``steps`` with plain AdamW; return (mean max/mean of the last 10
    steps, eval stats on held-out batches)."""
    model = _tiny(seed)
    bal = ExpertBalancer(model, gamma=gamma)
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(7))
    if boost:
        # Bend experts 0 and 1 towards the mean router input: most tokens pick them. The router
        # weights are then frozen so the LM gradient cannot undo it (which it does quickly).
        inputs = {}

        def grab(module, args, output):
            inputs[module] = args[0].detach().reshape(-1, args[0].shape[-1])

        handles = [r.register_forward_hook(grab) for _, r in bal.routers]
        with torch.no_grad():
            model(_chain_batch(gen, perm))
        for h in handles:
            h.remove()
        for _, r in bal.routers:
            x = inputs[r]
            d = x.mean(0) / x.mean(0).norm()
            with torch.no_grad():
                r.weight[:2] += boost * d / (x @ d).mean()
            r.weight.requires_grad_(False)
    if collapse:
        # A collapsed router: experts 0 and 1 win every token (scores are sigmoids in (0, 1)).
        with torch.no_grad():
            for _, r in bal.routers:
                r.e_score_correction_bias[:2] += 0.5
    bal.reset()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    history = []
    for _ in range(steps):
        x = _chain_batch(gen, perm)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(bal.update()["max_over_mean"])
    model.eval()
    with torch.no_grad(), bal.collecting():
        model(torch.cat([_chain_batch(gen, perm), _chain_batch(gen, perm)]))
    return sum(history[-10:]) / 10, bal.eval_stats()


def test_balancing_repairs_collapsed_routing():
    without_train, without = _train(0.0, collapse=True)
    with_train, balanced = _train(0.01, collapse=True)
    assert without["max_over_mean"] == pytest.approx(4.0)  # stays collapsed
    assert without_train == pytest.approx(4.0)
    assert balanced["max_over_mean"] < 0.5 * without["max_over_mean"]
    assert with_train < 0.5 * without_train
    assert balanced["entropy_min"] > without["entropy_min"] + 0.4


def test_balancing_counters_perturbed_router_weights():
    without_train, without = _train(0.0, boost=8.0)
    with_train, balanced = _train(0.01, boost=8.0)
    assert without["max_over_mean"] > 1.6  # the perturbation persists without balancing
    assert balanced["max_over_mean"] < 0.8 * without["max_over_mean"]
    assert with_train < 0.8 * without_train
    assert balanced["entropy_min"] > without["entropy_min"]


# --------------------------------------------------------------------------- data parallel


def _dp_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = build_model(model_config("tiny", 256), device_type="cpu").train()
        bal = ExpertBalancer(model, gamma=0.01)
        if rank == 1:  # diverged start: sync_bias must fix it
            with torch.no_grad():
                for _, r in bal.routers:
                    r.e_score_correction_bias.fill_(0.3)
        bal.sync_bias()
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(100 + rank))
        model(ids)  # different data on each rank
        local = bal.counts()
        stats = bal.update()
        biases = [r.e_score_correction_bias.tolist() for _, r in bal.routers]
        with open(f"{out_dir}/rank{rank}.json", "w") as fh:
            json.dump(
                {
                    "local": local.tolist(),
                    "load": [s["load"] for s in stats["layers"].values()],
                    "bias": biases,
                },
                fh,
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_reduced_counts_and_identical_bias_over_gloo(tmp_path):
    mp.spawn(_dp_worker, args=(2, str(tmp_path / "rdzv"), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    summed = (torch.tensor(r0["local"]) + torch.tensor(r1["local"])).tolist()
    assert r0["local"] != r1["local"]  # the ranks saw different tokens
    assert r0["load"] == summed and r1["load"] == summed
    assert r0["bias"] == r1["bias"]
    load = torch.tensor(summed, dtype=torch.float64)
    expected = 0.01 * torch.sign(load.mean(-1, keepdim=True) - load)
    torch.testing.assert_close(torch.tensor(r0["bias"]), expected.float())
