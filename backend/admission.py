"""Admission of a job spec at submit: everything that can be known before a worker starts is refused here, with the
reason, instead of failing in the worker (or waiting forever on a queue nobody consumes).

    admit(session, user, spec, settings)    # raises Refused (422), crud.NotFound (404), crud.Conflict (409)

In order: the algorithm registered on the worker (worker/tlt/rl/algorithms/registry.py, read without torch); the
rollout backend installed and able to honour the spec's settings (worker/tlt/rollout_backends.py); paths
only inside TLT_SPEC_ROOTS; uploaded datasets and artifacts by id only the user's own (someone
else's is the same 404 as a missing one); the user's artifact quota; the model's context and depth (built-in models);
a live registered worker that consumes the job's queue with enough GPUs and memory for its KV cache; and memory for
what the job will allocate (drafter buffer, rollout batch) and a system prompt that leaves room for a prompt
(backend/admission_sizes.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session

from backend.admission_sizes import SizeRefused, check_memory, check_system_prompt
from backend.core.config import Settings
from backend.job_spec_paths import spec_path_errors
from backend.persistence import crud
from backend.persistence.models import User, Worker
from worker.tlt.builtin_models import BUILTIN_MODELS
from worker.tlt.config import CPU_KV_CACHE_GB, ArtifactRef, JobSpec
from worker.tlt.rl.algorithms.registry import registered_names
from worker.tlt.rollout_backends import backend_installed, backend_refusals

EAGLE3_MIN_LAYERS = 4  # its features come from layers 2, L//2 and L-3 (worker/tlt/speculative/drafter/model.py eagle3_layers)
GB = 1024**3


class Refused(ValueError):
    """A spec that cannot be admitted: `loc` names the field (as a pydantic error's loc, under body.spec)."""

    def __init__(self, loc: tuple[str, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc, self.msg = ("body", "spec", *loc), msg

    def as_error(self) -> dict[str, object]:
        return {"loc": self.loc, "msg": self.msg, "type": "value_error"}


def admit(session: Session, user: User, spec: JobSpec, settings: Settings) -> None:
    check_algorithm(spec)
    check_backend(spec)
    for loc, msg in spec_path_errors(spec, settings.spec_root_paths, settings.private_dirs):
        raise Refused(loc, msg)
    check_references(session, user, spec)
    check_quota(session, user, settings.user_quota_gb)
    check_model_fits(spec)
    live = crud.live_workers(session, settings.worker_ttl_s)
    check_workers(live, spec)
    check_sizes(live, spec)


def check_algorithm(spec: JobSpec) -> None:
    """The spec's algorithm is one the worker has registered (built-in or installed under `tlt.algorithms`)."""
    name, names = spec.algorithm.algorithm_name, registered_names()
    if name not in names:
        raise Refused(("algorithm", "name"), f"unknown algorithm {name!r}; registered: {', '.join(names)}")


def check_backend(spec: JobSpec) -> None:
    """The rollout backend honours every setting the spec makes (worker/tlt/rollout_backends.py) and is installed."""
    for loc, why in backend_refusals(spec):
        raise Refused(loc, f"rollout.backend {spec.rollout.backend}: {why}")
    if not backend_installed(spec.rollout.backend):
        raise Refused(("rollout", "backend"), f"rollout.backend {spec.rollout.backend}: vLLM is not installed on "
                      "this service (pip install 'tlt-studio[vllm]' where the API and the workers run)")


def check_references(session: Session, user: User, spec: JobSpec) -> None:
    """Uploaded datasets and artifacts named by id: the user's own (NotFound otherwise), of the right kind."""
    if spec.dataset.dataset_id is not None:
        try:
            crud.get_dataset(session, user, spec.dataset.dataset_id)
        except crud.NotFound:
            raise Refused(("dataset", "dataset_id"), f"dataset {spec.dataset.dataset_id!r} not found "
                          "(upload it with POST /api/v1/datasets)") from None
    refs: list[tuple[tuple[str, ...], int | None, str]] = [(("model", "artifact_id"), spec.model.artifact_id, "policy")]
    if isinstance(spec.drafter.warm_start, ArtifactRef):
        refs.append((("drafter", "warm_start", "artifact_id"), spec.drafter.warm_start.artifact_id, "drafter"))
    for loc, artifact_id, kind in refs:
        if artifact_id is None:
            continue
        art = crud.get_artifact(session, user, artifact_id)  # NotFound (404) for a missing or someone else's
        if art.kind != kind:
            raise Refused(loc, f"artifact {artifact_id} is a {art.kind}, not a {kind}")
        if art.deleted_at is not None:
            raise Refused(loc, f"artifact {artifact_id} was deleted by retention")


def check_quota(session: Session, user: User, quota_gb: float, adding: int = 0) -> None:
    """Conflict when the user's artifacts and uploaded datasets (plus `adding` bytes about to be stored) pass the
    quota."""
    if quota_gb <= 0:
        return
    artifacts, datasets = crud.user_artifact_bytes(session, user), crud.user_dataset_bytes(session, user)
    used, quota = artifacts + datasets, quota_gb * GB
    if (used + adding > quota) if adding else (used >= quota):  # a submit needs room left; an upload, its bytes
        more = f" and this upload {adding / GB:.2f} GB" if adding else ""
        raise crud.Conflict(
            f"storage quota exceeded: your jobs hold {artifacts / GB:.2f} GB of artifacts, your datasets "
            f"{datasets / GB:.2f} GB{more} (quota {quota_gb:g} GB, TLT_USER_QUOTA_GB); delete old jobs' artifacts "
            "or datasets (DELETE /api/v1/datasets/{id}), or ask an operator to raise the quota")


def check_model_fits(spec: JobSpec) -> None:
    """For built-in models (their shape is known without loading): prompt + completion within the context, and
    EAGLE-3 only on a target deep enough for its three feature layers."""
    if spec.model.builtin is None:
        return
    shape = BUILTIN_MODELS[spec.model.builtin]  # the schema accepts only this table's names
    context, layers = shape.context, shape.layers
    longest = spec.dataset.max_prompt_length + spec.algorithm.max_completion_length
    if longest > context:
        raise Refused(("algorithm", "max_completion_length"),
                      f"max_prompt_length + max_completion_length = {longest} tokens exceeds the context of "
                      f"{spec.model.builtin} ({context} tokens)")
    if spec.drafter.kind == "eagle3" and layers < EAGLE3_MIN_LAYERS:
        raise Refused(("drafter", "kind"), f"EAGLE-3 needs a target with >= {EAGLE3_MIN_LAYERS} layers; "
                      f"{spec.model.builtin} has {layers}")


def check_sizes(live: Sequence[Worker], spec: JobSpec) -> None:
    """What the job will allocate fits some worker that could take it; its system prompt leaves room for a prompt
    (backend/admission_sizes.py)."""
    candidates = [w for w in live if spec.queue in w.queues and w.gpus >= spec.resources.gpus]
    try:
        check_system_prompt(spec)
        check_memory(candidates, spec)
    except SizeRefused as e:
        raise Refused(e.loc, e.msg) from None


def check_workers(live: Sequence[Worker], spec: JobSpec) -> None:
    """Some live worker consumes the job's queue, has its GPUs, and memory for its KV cache (per GPU for a GPU job,
    host RAM for a CPU job)."""
    queue, gpus, kv_gb = spec.queue, spec.resources.gpus, spec.rollout.kv_cache_gb
    if not live:
        raise Refused(("resources", "queue"), "no worker is running (none has registered a heartbeat recently); "
                      "start one with `celery -A worker.celery_app worker` or `tlt up`")
    on_queue = [w for w in live if queue in w.queues]
    if not on_queue:
        known = sorted({q for w in live for q in w.queues})
        raise Refused(("resources", "queue"), f"no live worker consumes queue {queue!r} (known: {', '.join(known)})")
    with_gpus = [w for w in on_queue if w.gpus >= gpus]
    if not with_gpus:
        most = max(w.gpus for w in on_queue)
        raise Refused(("resources", "gpus"), f"the job asks for {gpus} GPU(s); the workers on queue {queue!r} have "
                      f"at most {most}")
    if kv_gb is None:
        if gpus > 0:
            return  # planned from the GPU's free memory when the job starts
        kv_gb = CPU_KV_CACHE_GB
    memory = [w.gpu_memory_gb if gpus > 0 else w.host_memory_gb for w in with_gpus]
    if kv_gb > max(memory):
        where = "GPU memory" if gpus > 0 else "host memory"
        raise Refused(("rollout", "kv_cache_gb"), f"kv_cache_gb {kv_gb:g} exceeds the {where} of every worker that "
                      f"could run the job (at most {max(memory):.1f} GB)")
