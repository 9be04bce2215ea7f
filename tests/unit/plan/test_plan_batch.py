"""The planner proposes the largest micro batch that fits at the same global batch
(dsflow.plan.batch)."""

from __future__ import annotations

from test_plan import GB, _args, _params

from dsflow.plan import batch, layouts, request


def _request(micro: int, accum: int, gpu_gb: int) -> request.Request:
    params = _params("profiles/rtx4090x3.yaml")
    params["train"].update(micro_batch=micro, grad_accum=accum)
    return request.resolve(params, _args("--gpu-mem", str(gpu_gb)))


def test_the_classic_setup_at_micro_4_is_offered_micro_8_on_24_gb_and_16_on_40():
    """3 x 24 GB, ZeRO-2, the medium MoE at 16 sequences per rank and step: micro 8 x 2
    fits (micro 16 does not); on 40 GB cards micro 16 x 1 does."""
    for gpu_gb, expected in ((24, (8, 2)), (40, (16, 1))):
        req = _request(4, 4, gpu_gb)

        def fits(est, req=req):
            return layouts.verdict(est, req.gpu_mem_bytes)[0]

        micro, accum, est = batch.largest_micro(req.config, req, fits)
        assert (micro, accum) == expected and est["gpu"]["total"] <= gpu_gb * GB
        line = batch.note(req.config, req, fits)
        assert line.startswith(f"train.micro_batch: {micro} with train.grad_accum: {accum}")


def test_nothing_is_offered_when_the_micro_batch_is_already_the_largest_that_fits():
    req = _request(8, 2, 24)

    def fits(est):
        return layouts.verdict(est, req.gpu_mem_bytes)[0]

    assert batch.largest_micro(req.config, req, fits) is None
    assert batch.note(req.config, req, fits) is None


def test_the_plan_notes_the_larger_micro_batch_and_the_layouts_communication():
    from dsflow.plan import stage

    params = _params("profiles/rtx4090x3.yaml")
    params["train"].update(micro_batch=4, grad_accum=4)
    notes = stage.build_plan(params, _args("--gpu-mem", "24"))["notes"]
    assert any(n.startswith("train.micro_batch: 8 with train.grad_accum: 2") for n in notes)
    assert any(n.startswith("communication (ZeRO-2, accum 4): ") for n in notes), notes
    one = _params("profiles/rtx4090x3.yaml")
    one["train"].update(gpus=1, micro_batch=8, grad_accum=2)
    notes = stage.build_plan(one, _args("--gpu-mem", "24", "--gpus", "1"))["notes"]
    assert not any(n.startswith(("communication", "train.micro_batch")) for n in notes), notes


def test_the_plan_chooses_the_reduce_buckets_and_the_train_stage_takes_its_choice():
    """train.zero.reduce_bucket_size: auto on 3 x 24 GB: the bucket whose transfer takes 2% of
    a micro-step (comm.bucket_for), counted in the plan's memory and named in its note; the
    train stage hands DeepSpeed the bucket its memory plan was made with. A number stays."""
    from dsflow.plan import comm
    from dsflow.train import stage as train_stage

    params = _params("profiles/rtx4090x3.yaml")
    assert params["train"]["zero"]["reduce_bucket_size"] == "auto"
    req = request.resolve(params, _args("--gpu-mem", "24"))
    chosen = req.bucket_sizes[0]
    assert chosen == comm.bucket_for(req) and comm.BUCKET_FLOOR <= chosen < 200_000_000
    assert f"reduce buckets of {chosen / 1e6:g}M elements" in comm.note(req)
    plan = layouts.assess(req)
    resolved = train_stage.with_planned_bucket(params, plan)
    assert resolved["train"]["zero"]["reduce_bucket_size"] == chosen
    # Smaller buckets than DeepSpeed's 200M: less memory for ZeRO-2's two reduce buffers.
    params["train"]["zero"]["reduce_bucket_size"] = 200_000_000
    fixed = request.resolve(params, _args("--gpu-mem", "24"))
    assert fixed.bucket_sizes[0] == 200_000_000
    assert train_stage.with_planned_bucket(params, layouts.assess(fixed)) is params
    assert layouts.assess(fixed)["estimate"]["gpu"]["total"] > plan["estimate"]["gpu"]["total"]


def test_a_larger_micro_batch_is_planned_with_its_own_auto_bucket():
    """The auto bucket grows with the micro-step: the micro batch the plan offers is estimated
    with the bucket the train stage would choose for it, not the current one's."""
    import dataclasses

    from dsflow.plan import comm

    req = _request(4, 4, 40)
    assert req.bucket_auto

    def fits(est):
        return layouts.verdict(est, req.gpu_mem_bytes)[0]

    micro, accum, est = batch.largest_micro(req.config, req, fits)
    offered = dataclasses.replace(req, micro_batch=micro, grad_accum=accum)
    assert est["inputs"]["bucket_sizes"][0] == comm.bucket_for(offered) > req.bucket_sizes[0]
