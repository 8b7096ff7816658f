# The image the Helm chart runs (router, Ray head/workers, mooncake_master):
#   docker build -t ghcr.io/hybridpd/hybridpd:0.1.0 .
# CPU engines by default. For CUDA engines build with a CUDA torch:
#   docker build --build-arg TORCH_SPEC="torch==2.13.0" --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim-bookworm

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"

# Mooncake's transfer engine needs the RDMA userspace libraries even over TCP.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnl-3-200 libnl-route-3-200 gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/hybridpd
COPY requirements/ requirements/
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC" \
 && grep -v '^torch==' requirements/runtime.txt > /tmp/runtime.txt \
 && pip install --no-cache-dir -r /tmp/runtime.txt \
 && pip install --no-cache-dir --no-deps -r requirements/nixl.txt

COPY pyproject.toml setup.py README.md ./
COPY hybridpd/ hybridpd/
COPY services/ services/
COPY launch/ launch/
COPY bench/ bench/
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y

# Build the bundled models into the image (HYBRIDPD_HOME), so pods start without building them:
# the chart's pods run with a read-only root filesystem.
ENV HYBRIDPD_HOME=/opt/hybridpd/home RAY_USAGE_STATS_ENABLED=0
RUN python -m hybridpd.models.bundled --model tiny && python -m hybridpd.models.bundled --model tiny-random

# Not root: Ray runs as the same user ray (uid and gid 1000, the chart's podSecurityContext) in every pod of
# the RayCluster. What it writes goes to /tmp (Ray's /tmp/ray, hybridpd up's workdir) and HOME (caches),
# both emptyDir volumes in the chart's pods; the image's files are only read.
# HYBRIDPD_HOME stays the user's, for a model built at first use where the root filesystem is writable.
RUN groupadd --gid 1000 ray && useradd --create-home --uid 1000 --gid 1000 ray && chown -R ray:ray /opt/hybridpd/home
ENV HOME=/home/ray
USER 1000:1000
EXPOSE 8000 50051
ENTRYPOINT []
CMD ["hybridpd", "up", "--config", "/etc/hybridpd/config.yaml"]
