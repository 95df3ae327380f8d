"""Jobs and the queue: job records in Redis (``JobStore``), the job types, submitting and finishing jobs, the task
streams and the worker loop that admits every task the same way."""

from dfp_shared import public_face

__getattr__, __all__ = public_face(__name__, {
    "store": ["JobStore", "JobRecord", "JobState", "JobNotFound", "IllegalTransition"],
    "types": ["JobType", "job_type"],
    "submit": ["queue_job"],
    "flow": ["finish_job", "advance_pipeline"],
    "queue": ["TaskQueue", "Task"],
    "worker": ["Worker", "JobHandler", "TaskContext"],
    "failures": ["CannotSucceed", "ModelRefused"],
    "redis_conn": ["connect"],
})
