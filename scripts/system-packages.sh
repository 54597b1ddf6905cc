#!/usr/bin/env bash
# System packages the tests drive for real: bubblewrap (the sandboxed code tool), PostgreSQL
# (the store suite runs on both back ends), Chromium (the dashboard's browser test). Installed
# with apt only when missing, so a machine that has them skips apt entirely. Needs root (or
# sudo); without either it says what to install and fails.
set -euo pipefail
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
[ -x /usr/lib/postgresql/15/bin/initdb ] || need+=(postgresql-15)
command -v chromium >/dev/null || need+=(chromium)
[ "${#need[@]}" -eq 0 ] && exit 0
sudo=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then sudo=(sudo); else
        echo "missing system packages: ${need[*]} (install them as root: apt-get install ${need[*]})" >&2
        exit 1
    fi
fi
echo "installing system packages: ${need[*]}"
"${sudo[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${need[@]}"
