"""Ray actor classes for the workers (named ``prefill-<i>`` / ``decode-<i>``, so
they are easy to find in the Ray dashboard) and their namespace, which carries
the release and the model identity: a router attaches by name only to actors of
its own release serving its own model's bytes."""

from __future__ import annotations

import re

import ray

import hybridpd
from services.decode.actor import DecodeWorker
from services.prefill.actor import PrefillWorker

NAMESPACE = "hybridpd"


def namespace(identity: str | None) -> str:
    """``hybridpd-<release>-<identity>`` (characters Ray's dashboard shows as they are);
    ``identity`` None (a model the router has no files of): the release alone."""
    tail = "" if identity is None else "-" + re.sub(r"[^A-Za-z0-9._-]", "_", identity)
    return "%s-%s%s" % (NAMESPACE, hybridpd.__version__, tail)


PrefillActor = ray.remote(PrefillWorker)
DecodeActor = ray.remote(DecodeWorker)
