# syntax=docker/dockerfile:1
# The daemon as a container image: `docker build -t direct-frontend .`
# Two stages: wheels are built from the source tree, then installed into a slim
# runtime image that runs as an unprivileged user. The fleet file is mounted at
# /etc/direct-frontend/fleet.toml (deploy/kubernetes/ mounts it from a ConfigMap),
# the tokenizer directory wherever the fleet file's tokenizer says.
#
# The dependencies' wheels are built, and installed, from pyproject.toml alone, before
# any source is copied: a source change rebuilds only the small direct-frontend wheel and
# its layer. The base is an exact Python release on an exact Debian (override with
# --build-arg PYTHON_IMAGE=...; pin a digest, python:...@sha256:..., for reproducibility).
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
    && pip wheel --no-cache-dir --wheel-dir /deps -r requirements.txt
COPY README.md ./
COPY direct_frontend ./direct_frontend
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /app .

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin frontend
# bind mounts, not COPY: the wheels never become a layer of their own
RUN --mount=type=bind,from=build,source=/deps,target=/deps \
    pip install --no-cache-dir --no-index /deps/*.whl
RUN --mount=type=bind,from=build,source=/app,target=/app \
    pip install --no-cache-dir --no-index --no-deps /app/*.whl
# stored responses and conversations (SQLite, the default store): a volume of the user's
RUN mkdir -p /var/lib/direct-frontend && chown 10001 /var/lib/direct-frontend \
    && chmod 0700 /var/lib/direct-frontend
VOLUME /var/lib/direct-frontend
USER 10001
EXPOSE 8000
ENV PYTHONUNBUFFERED=1 STATE_DIRECTORY=/var/lib/direct-frontend
# /health answers 200 while the daemon's event loop runs (slim has no curl: Python's urllib).
# A fleet that listens elsewhere than port 8000 sets HEALTHCHECK_URL to match.
ENV HEALTHCHECK_URL=http://127.0.0.1:8000/health
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['HEALTHCHECK_URL'], timeout=4)"]
ENTRYPOINT ["direct-frontend"]
CMD ["run", "/etc/direct-frontend/fleet.toml"]
