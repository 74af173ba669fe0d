#!/usr/bin/env bash
# Run config/direct-frontend.service under a real systemd, installed as docs/systemd.md says,
# on a machine (or container) where systemd is not PID 1: systemd boots as PID 1 of a PID and
# mount namespace of its own, with /etc, /opt, /run, /tmp and /var/tmp overlaid or private,
# so nothing of the install reaches the host.
#
#   sudo scripts/systemd_in_namespace.sh        # as root; a virtualenv with the daemon active
#
# The install is the docs' shell block from step 2 on, verbatim but for `sudo` and the
# demo model and fleet standing in for yours; step 1 (the virtualenv in /opt) is made from
# the active environment's packages and this tree, for the system python3 of the same
# minor version (the service user cannot read a Python under /root). Then: /health,
# /ready, a chat completion with and without a key, `systemctl reload`, `systemctl stop`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SYSTEM_PYTHON=${SYSTEM_PYTHON:-/usr/bin/python3}
PORT=${PORT:-18431}
SITE=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 1; }
want=$(python -c 'import sys; print(sys.version_info[:2])')
have=$("$SYSTEM_PYTHON" -c 'import sys; print(sys.version_info[:2])')
[ "$want" = "$have" ] || { echo "$SYSTEM_PYTHON is $have, the environment $want" >&2; exit 1; }

WORK=$(mktemp -d /var/tmp/direct-frontend-systemd.XXXXXX)  # seen inside as /run/df-check
SYSTEMD_PID=
cleanup() {
    if [ -n "$SYSTEMD_PID" ]; then kill -KILL "$SYSTEMD_PID" 2>/dev/null || true; fi
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

cat > "$WORK/fleet.toml" <<FLEET
[frontend]
listen = "127.0.0.1:$PORT"
served_model_name = "demo"
tokenizer = "model"

[frontend.auth]
api_keys_env = "DIRECT_FRONTEND_API_KEYS"

[[engine]]
name = "sim"
url = "grpc://127.0.0.1:$((PORT + 1))"
kind = "sglang"
simulate = true
FLEET

cat > "$WORK/boot.sh" <<'BOOT'
set -e
work=$1
mount --make-rprivate /
for dir in etc opt; do
    mkdir -p "$work/$dir-up" "$work/$dir-work"
    mount -t overlay overlay \
        -o "lowerdir=/$dir,upperdir=$work/$dir-up,workdir=$work/$dir-work" "/$dir"
done
mount -t tmpfs tmpfs /run
mkdir /run/df-check && mount --bind "$work" /run/df-check
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /var/tmp
rm -rf /etc/systemd/system/*.wants  # the host's enabled units stay out
exec env container=direct-frontend-check /lib/systemd/systemd --system --unit=multi-user.target
BOOT

cat > "$WORK/venv.sh" <<'VENV'
set -e
python=$1 site=$2 root=$3
"$python" -m venv --without-pip /opt/direct-frontend/venv
mkdir -p /opt/direct-frontend/lib
cp -a "$site"/. /opt/direct-frontend/lib/
rm -f /opt/direct-frontend/lib/__editable__*  # an editable install points elsewhere
cp -a "$root/direct_frontend" /opt/direct-frontend/lib/
venv_site=$(/opt/direct-frontend/venv/bin/python -c \
    'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo /opt/direct-frontend/lib > "$venv_site/lib.pth"
printf '#!/opt/direct-frontend/venv/bin/python\nfrom direct_frontend.cli import main\nmain()\n' \
    > /opt/direct-frontend/venv/bin/direct-frontend
chmod 755 /opt/direct-frontend/venv/bin/direct-frontend
VENV

python - "$WORK" <<'STEPS'
import pathlib, sys
doc = pathlib.Path("docs/systemd.md").read_text()
block = doc.split("## Install", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
steps = block[block.index("# 2."):].replace("sudo ", "")
steps = steps.replace(" fleet.toml /etc", " /run/df-check/fleet.toml /etc")
steps = steps.replace("my-model-dir/*", "config/demo-model/*")
pathlib.Path(sys.argv[1], "install.sh").write_text("set -ex\n" + steps)
STEPS

cat > "$WORK/probe.sh" <<'PROBE'
url=$1
chat='{"model":"demo","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'
code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
for _ in $(seq 50); do curl -sf "$url/ready" >/dev/null && break; sleep 0.2; done
echo "GET /health: $(code "$url/health"); GET /ready: $(code "$url/ready")"
echo "chat with a key: $(code -H 'Authorization: Bearer sk-first' \
    -H 'content-type: application/json' -d "$chat" "$url/v1/chat/completions")"
echo "chat without one: $(code -H 'content-type: application/json' -d "$chat" \
    "$url/v1/chat/completions")"
systemctl reload direct-frontend && sleep 1
systemctl show direct-frontend -p ActiveState -p SubState -p StatusText -p NRestarts
systemctl stop direct-frontend
systemctl show direct-frontend -p ActiveState -p Result
journalctl -u direct-frontend -o cat --no-pager | tail -4
PROBE

unshare --pid --fork --kill-child --mount-proc --mount --uts --cgroup \
    bash "$WORK/boot.sh" "$WORK" > "$WORK/boot.log" 2>&1 < /dev/null &
UNSHARE_PID=$!
for _ in $(seq 50); do
    SYSTEMD_PID=$(pgrep -P "$UNSHARE_PID" -x systemd || true)
    [ -n "$SYSTEMD_PID" ] && break
    sleep 0.2
done
[ -n "$SYSTEMD_PID" ] || { cat "$WORK/boot.log"; exit 1; }
inside() { nsenter -t "$SYSTEMD_PID" -m -p -u -C "$@"; }
state=
for _ in $(seq 50); do
    state=$(inside systemctl is-system-running 2>/dev/null || true)
    case $state in running|degraded) break ;; esac
    sleep 0.2
done
echo "systemd $(inside systemctl --version | head -1 | cut -d' ' -f2) is PID 1 ($state)"

inside bash /run/df-check/venv.sh "$SYSTEM_PYTHON" "$SITE" "$ROOT"
inside bash -c "cd '$ROOT' && bash /run/df-check/install.sh" 2>&1 | grep -v '^ ' || true
inside bash /run/df-check/probe.sh "http://127.0.0.1:$PORT"
