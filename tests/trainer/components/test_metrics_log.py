"""Live training metrics: one tiny run on S3 writes TensorBoard event files (read back by
TensorBoard's own reader), logs to a real MLflow server and records the job's metric history."""

from __future__ import annotations

import pytest
from dfp_shared.jobs.store import JobStore
from dfp_shared.storage.store import open_store
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.loop.progress import job_hooks
from dfp_trainer.run import train

from tests.trainer.train_support import run_config, tiny_spec, torch_threads

STEPS, LOG_EVERY, EVAL_EVERY, BLOCK = 6, 2, 3, 4


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, tiny_qwen3_dir, tiny_dataset, redis_server, s3_server, mlflow_server):
    import uuid

    from tests.conftest import allow_storage

    bucket = s3_server.create_bucket("metrics-" + uuid.uuid4().hex[:8])
    allow_storage(bucket)
    output = f"{bucket}/runs/live"
    jobs = JobStore(redis_server.client())
    job, _ = jobs.create("train", {}, owner="alice")
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, output, steps=STEPS, block_size=BLOCK, log_every=LOG_EVERY,
                     eval_every=EVAL_EVERY, eval_prompts=2, eval_max_new_tokens=4)
    config = run_config(spec, evaluate=True, s3_endpoint_url=s3_server.endpoint_url,
                        mlflow_tracking_uri=mlflow_server, metrics_upload_every_s=0)
    with torch_threads(1):
        result = train(config, DistInfo(), hooks=job_hooks(redis_server.url, job.id))
    assert result.completed
    local = tmp_path_factory.mktemp("tb")
    store = open_store(f"{output}/tensorboard", endpoint_url=s3_server.endpoint_url)
    for key in store.list(""):
        (local / key).parent.mkdir(parents=True, exist_ok=True)
        (local / key).write_bytes(store.get(key))
    return {"result": result, "tb_dir": local, "jobs": jobs, "job_id": job.id, "output": output,
            "mlflow": mlflow_server}


def _logged_steps() -> list[int]:
    return sorted({s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s % EVAL_EVERY == 0} | {STEPS})


def test_event_files_load_in_tensorboards_reader_with_every_tag_and_step(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logged_run["tb_dir"]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/accuracy", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "train/data_wait_fraction", "train/comm_fraction", "eval/heldout_loss", "eval/heldout_accuracy",
                "eval/tau", "eval/tau_predicted", *(f"train/accuracy_pos_{k}" for k in range(1, BLOCK))}
    assert expected <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == _logged_steps()
    # mid-training evaluation at step 3, the final one (trained tau, held-out loss) at the last step
    assert [e.step for e in acc.Scalars("eval/tau")] == [EVAL_EVERY, STEPS]
    assert acc.Scalars("eval/tau")[-1].value == pytest.approx(logged_run["result"].outputs["tau_trained"])
    assert all(e.value >= 1.0 for e in acc.Scalars("eval/tau"))
    # beside each measured tau, the one the held-out per-position accuracies predict
    assert [e.step for e in acc.Scalars("eval/tau_predicted")] == [EVAL_EVERY, STEPS]
    assert acc.Scalars("eval/tau_predicted")[-1].value == pytest.approx(logged_run["result"].outputs["tau_predicted"])
    assert all(1.0 <= e.value <= BLOCK for e in acc.Scalars("eval/tau_predicted"))


def test_the_same_run_is_in_mlflow(logged_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=logged_run["mlflow"])
    experiment = client.get_experiment_by_name("dflash-pipeline")
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`dflash.output` = '{logged_run['output']}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == _logged_steps()
    assert [m.step for m in client.get_metric_history(run_id, "eval/heldout_loss")] == [EVAL_EVERY, STEPS]
    assert runs[0].data.params["block_size"] == str(BLOCK)


def test_the_job_keeps_its_metric_history_and_streams_each_point(logged_run):
    jobs, job_id = logged_run["jobs"], logged_run["job_id"]
    points = jobs.metrics(job_id)
    assert [p["step"] for p in points] == _logged_steps()
    assert "tau" in points[1] and points[1]["step"] == EVAL_EVERY
    assert points[-1]["tau"] == pytest.approx(logged_run["result"].outputs["tau_trained"])
    assert points[-1]["loss"] > 0 and "accuracy_pos_1" in points[-1]  # the last train point kept its figures
    assert [p["step"] for p in jobs.metrics(job_id, after_step=EVAL_EVERY, limit=1)] == [4]
    streamed = [d["step"] for _, kind, d in jobs.events(job_id, count=1000) if kind == "metrics"]
    assert streamed == [*_logged_steps(), STEPS]  # the final evaluation is sent as a point of its own
    assert jobs.get(job_id).counters["tau"] == pytest.approx(points[-1]["tau"])


def test_the_report_plots_tau_over_training_steps(logged_run, s3_server):
    import json

    out = open_store(logged_run["output"], endpoint_url=s3_server.endpoint_url)
    report = json.loads(out.get("report.json"))
    assert [p["step"] for p in report["tau_curve"]] == [0, EVAL_EVERY, STEPS]
    assert report["tau_curve"][-1]["tau"] == pytest.approx(report["evaluation"]["tau_trained"])
    assert all("tau" in p and "tau_predicted" in p for p in report["tau_curve"])  # the target is in-process
    ev = report["evaluation"]
    assert report["tau_curve"][-1]["tau_predicted"] == pytest.approx(ev["tau_predicted"])
    assert ev["tau_gap"] == pytest.approx(ev["tau_predicted"] - ev["tau_trained"])
    assert isinstance(ev["train_serve_mismatch"], bool) and ev["mismatch_reason"]
    assert out.get("tau_curve.png")[:8] == b"\x89PNG\r\n\x1a\n"
    outputs = logged_run["result"].outputs
    assert f"{logged_run['output']}/tau_curve.png" in outputs["plots"]
    assert outputs["tensorboard"] == f"{logged_run['output']}/tensorboard/"
    assert outputs["tau_predicted"] == ev["tau_predicted"] and outputs["train_serve_mismatch"] == ev["train_serve_mismatch"]
