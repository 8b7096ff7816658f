"""Ray actor classes for the workers (named ``prefill-<i>`` / ``decode-<i>``
in namespace ``hybridpd``, so they are easy to find in the Ray dashboard)."""

from __future__ import annotations

import ray

from services.decode.actor import DecodeWorker
from services.prefill.actor import PrefillWorker

NAMESPACE = "hybridpd"

PrefillActor = ray.remote(PrefillWorker)
DecodeActor = ray.remote(DecodeWorker)
