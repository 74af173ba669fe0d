# The daemon as a container image: `docker build -t direct-frontend .`
# Two stages: a wheel is built from the source tree, then installed into a slim
# runtime image that runs as an unprivileged user. The fleet file is mounted at
# /etc/direct-frontend/fleet.toml (deploy/kubernetes/ mounts it from a ConfigMap),
# the tokenizer directory wherever the fleet file's tokenizer says.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY direct_frontend ./direct_frontend
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin frontend
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001
EXPOSE 8000
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["direct-frontend"]
CMD ["run", "/etc/direct-frontend/fleet.toml"]
