# syntax=docker/dockerfile:1
#
# The switchyard binary in a small runtime image.
#
#   docker build --build-arg SWITCHYARD_BUILD_COMMIT=$(git rev-parse --short HEAD) -t switchyard .
#   docker run --rm -p 8080:8080 switchyard serve --worker http://ENGINE:8000
#
# .git is not sent to the build (.dockerignore), so `switchyard --version`
# names the commit given as SWITCHYARD_BUILD_COMMIT, or `unknown` without it.
# The binary carries its tokenizer and default trace; the image holds only
# it and the CA certificates (for TLS to NATS, replica sync).

# Builder: the toolchain this repository is built and tested with. zmq-sys
# compiles the bundled libzmq with the C++ compiler the image has.
FROM rust:1.95-bookworm AS builder
WORKDIR /src
COPY . .
ARG SWITCHYARD_BUILD_COMMIT=""
ENV SWITCHYARD_BUILD_COMMIT=${SWITCHYARD_BUILD_COMMIT}
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p switchyard \
    && cp target/release/switchyard /usr/local/bin/switchyard

# Runtime: the same Debian release as the builder (glibc), plus what the
# binary links dynamically besides glibc: libstdc++ and libgcc_s (libzmq is
# C++, linked in statically; see `ldd`).
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libstdc++6 libgcc-s1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 switchyard \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin switchyard
COPY --from=builder /usr/local/bin/switchyard /usr/local/bin/switchyard
# A numeric user, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001
# serve listens on loopback by default; in a container it must listen on
# all interfaces. As a SWITCHYARD_* variable this overrides a config file's
# `host`; a --host flag overrides it.
ENV SWITCHYARD_HOST=0.0.0.0
EXPOSE 8080
ENTRYPOINT ["switchyard"]
CMD ["--help"]
