#!/usr/bin/env bash
# Docker for the image tier (make test-images): Debian's docker.io and debootstrap installed when missing (as root,
# with apt-get), the daemon started when it does not answer. A daemon started here writes its pid to
# build/dockerd.pid and its log to build/dockerd.log; `make docker-stop` ends it by that pid.
set -euo pipefail
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing: ${need[*]} (install them; as root with apt-get this script does)" >&2
    exit 2
  fi
  echo "installing ${need[*]} (Debian packages)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null; }
fi
docker info >/dev/null 2>&1 && { echo "docker: the daemon answers"; exit 0; }
if [ "$(id -u)" != 0 ]; then
  echo "the Docker daemon does not answer, and only root can start it here" >&2
  exit 2
fi
mkdir -p build
nohup dockerd >build/dockerd.log 2>&1 &
echo $! >build/dockerd.pid
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then echo "dockerd started (pid $(cat build/dockerd.pid))"; exit 0; fi
  kill -0 "$(cat build/dockerd.pid)" 2>/dev/null || break
  sleep 1
done
echo "dockerd did not answer within 60 s; the end of build/dockerd.log:" >&2
tail -20 build/dockerd.log >&2
exit 1
