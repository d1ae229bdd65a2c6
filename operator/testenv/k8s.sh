#!/usr/bin/env bash
# A real Kubernetes control plane for the operator's tests, built from Debian bookworm's
# `kubernetes` source package (1.20.2) and run on 127.0.0.1 with token authentication.
#
#   k8s.sh build            build kube-apiserver, kube-scheduler and kube-controller-manager once
#                           into the cache ($WRK_K8S_CACHE, default ~/.cache/wrk-k8s); idempotent
#   k8s.sh start DIR        start etcd + the three servers with their state under DIR; prints how to
#                           reach them and writes DIR/kubeconfig and DIR/env
#   k8s.sh stop DIR         stop what `start DIR` started (by the process ids it recorded)
#
# Ports for `start` (defaults in brackets): WRK_K8S_API_PORT [6443], WRK_K8S_ETCD_PORT [2379],
# WRK_K8S_ETCD_PEER_PORT [2380]. The scheduler and controller-manager serve no ports.
#
# Known traps handled here (../../../shared/FACTS.md, Kubernetes): the vendored modern-go/reflect2
# 1.0.1 segfaults under Go 1.19 on the first custom resource, so Debian's 1.0.2 replaces it; the
# node-lifecycle controller is left out (it would mark the fake, kubelet-less nodes unreachable);
# the scheduler gets no --authentication-kubeconfig. The controller-manager runs the deployment,
# replicaset and job controllers (a WrkJob's submitting Job gets its pod and its conditions from
# the real Job controller), the garbage collector and the service-account controllers.
set -euo pipefail

CACHE="${WRK_K8S_CACHE:-$HOME/.cache/wrk-k8s}"
BIN="$CACHE/bin"
SERVERS=(kube-apiserver kube-scheduler kube-controller-manager)

log() { echo "k8s.sh: $*" >&2; }

have_binaries() {
    local s
    for s in "${SERVERS[@]}"; do
        [[ -x "$BIN/$s" ]] || return 1
    done
}

install_packages() {
    local missing=()
    local p
    for p in golang-go etcd-server golang-github-modern-go-reflect2-dev dpkg-dev make rsync openssl; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2
    fi
}

enable_deb_src() {
    # `apt-get source` needs a deb-src entry for bookworm main; add one of our own if none exists.
    if ! grep -rqsE '^(deb-src|Types:.*deb-src)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        log "adding a deb-src entry for bookworm main"
        cat >/etc/apt/sources.list.d/wrk-deb-src.sources <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    fi
}

build() {
    if have_binaries; then
        log "binaries cached in $BIN"
        return 0
    fi
    log "one-time build of ${SERVERS[*]} from Debian's kubernetes source package (~20 min cold) into $CACHE"
    local started=$SECONDS
    mkdir -p "$CACHE/src" "$BIN"
    enable_deb_src
    apt-get update >&2
    install_packages

    local tree
    tree=$(find "$CACHE/src" -maxdepth 1 -type d -name 'kubernetes-1.20*' | head -n1)
    if [[ -z "$tree" ]]; then
        (cd "$CACHE/src" && apt-get source kubernetes >&2)
        tree=$(find "$CACHE/src" -maxdepth 1 -type d -name 'kubernetes-1.20*' | head -n1)
        [[ -n "$tree" ]] || { log "apt-get source kubernetes gave no kubernetes-1.20* tree"; exit 1; }
    fi

    # reflect2 1.0.1 (vendored) segfaults under Go 1.19; Debian ships the fixed 1.0.2.
    local vendored="$tree/vendor/github.com/modern-go/reflect2"
    local debian=/usr/share/gocode/src/github.com/modern-go/reflect2
    [[ -d "$debian" ]] || { log "$debian missing (golang-github-modern-go-reflect2-dev)"; exit 1; }
    if ! cmp -s "$debian/reflect2.go" "$vendored/reflect2.go"; then
        log "replacing vendored modern-go/reflect2 with Debian's 1.0.2"
        rm -rf "$vendored"
        mkdir -p "$vendored"
        # Only the package's Go sources: not tests or Debian's packaging files.
        find "$debian" -maxdepth 1 -type f -name '*.go' ! -name '*_test.go' -exec cp {} "$vendored/" \;
        [[ -f "$debian/go.mod" ]] && cp "$debian/go.mod" "$vendored/"
    fi

    local s
    for s in "${SERVERS[@]}"; do
        if [[ ! -x "$BIN/$s" ]]; then
            log "building $s"
            (cd "$tree" && make WHAT="cmd/$s" >&2)
            local out
            out=$(find "$tree/_output" -type f -name "$s" -perm -u+x | head -n1)
            [[ -n "$out" ]] || { log "make produced no $s"; exit 1; }
            cp "$out" "$BIN/$s.tmp" && mv "$BIN/$s.tmp" "$BIN/$s"
        fi
    done
    log "built ${SERVERS[*]} in $((SECONDS - started)) s"
}

wait_for() {
    # wait_for SECONDS DESCRIPTION COMMAND...
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            log "timed out waiting for $what"
            return 1
        fi
        sleep 0.5
    done
}

start() {
    local dir=$1
    have_binaries || { log "binaries missing: run '$0 build' first"; exit 1; }
    install_packages
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [[ -f "$dir/pids" ]]; then
        log "$dir/pids exists: stop that control plane first"
        exit 1
    fi
    local api_port=${WRK_K8S_API_PORT:-6443}
    local etcd_port=${WRK_K8S_ETCD_PORT:-2379}
    local peer_port=${WRK_K8S_ETCD_PEER_PORT:-2380}
    : >"$dir/pids"
    # On any failure below: show the logs' ends and stop what was started.
    trap 'log "start failed"; tail -n 20 "$dir"/*.log >&2 || true; stop "$dir"' ERR

    # Tokens: an admin in system:masters, and the users the built-in RBAC roles name.
    local admin_token sched_token kcm_token
    admin_token=$(openssl rand -hex 16)
    sched_token=$(openssl rand -hex 16)
    kcm_token=$(openssl rand -hex 16)
    cat >"$dir/tokens.csv" <<EOF
$admin_token,admin,admin,"system:masters"
$sched_token,system:kube-scheduler,kube-scheduler
$kcm_token,system:kube-controller-manager,kube-controller-manager
EOF
    openssl genrsa -out "$dir/sa.key" 2048 2>/dev/null
    openssl rsa -in "$dir/sa.key" -pubout -out "$dir/sa.pub" 2>/dev/null

    local server="https://127.0.0.1:$api_port"
    kubeconfig() {
        cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: wrk-test
  cluster:
    server: $server
    insecure-skip-tls-verify: true
users:
- name: $1
  user:
    token: $2
contexts:
- name: wrk-test
  context:
    cluster: wrk-test
    user: $1
    namespace: default
current-context: wrk-test
EOF
    }
    kubeconfig admin "$admin_token" >"$dir/kubeconfig"
    kubeconfig kube-scheduler "$sched_token" >"$dir/scheduler.kubeconfig"
    kubeconfig kube-controller-manager "$kcm_token" >"$dir/controller-manager.kubeconfig"

    etcd --name wrk-test --data-dir "$dir/etcd" \
        --listen-client-urls "http://127.0.0.1:$etcd_port" \
        --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-cluster "wrk-test=http://127.0.0.1:$peer_port" \
        >"$dir/etcd.log" 2>&1 &
    echo "$!" >>"$dir/pids"
    wait_for 30 etcd curl -sf "http://127.0.0.1:$etcd_port/health"

    "$BIN/kube-apiserver" \
        --etcd-servers "http://127.0.0.1:$etcd_port" \
        --bind-address 127.0.0.1 --secure-port "$api_port" --insecure-port 0 \
        --cert-dir "$dir/certs" \
        --token-auth-file "$dir/tokens.csv" \
        --authorization-mode RBAC \
        --service-cluster-ip-range 10.96.0.0/16 \
        --service-account-key-file "$dir/sa.pub" \
        --service-account-signing-key-file "$dir/sa.key" \
        --service-account-issuer https://kubernetes.default.svc \
        >"$dir/kube-apiserver.log" 2>&1 &
    echo "$!" >>"$dir/pids"
    wait_for 90 kube-apiserver curl -skf -H "Authorization: Bearer $admin_token" "$server/readyz"

    "$BIN/kube-scheduler" --kubeconfig "$dir/scheduler.kubeconfig" \
        --leader-elect=false --port 0 --secure-port 0 \
        >"$dir/kube-scheduler.log" 2>&1 &
    echo "$!" >>"$dir/pids"

    # Each controller acts as its own service account (system:controller:* roles): the
    # system:kube-controller-manager user alone may not create ReplicaSets or Pods.
    "$BIN/kube-controller-manager" --kubeconfig "$dir/controller-manager.kubeconfig" \
        --leader-elect=false --port 0 --secure-port 0 \
        --controllers deployment,replicaset,job,garbagecollector,serviceaccount,serviceaccount-token,namespace \
        --service-account-private-key-file "$dir/sa.key" \
        --use-service-account-credentials \
        >"$dir/kube-controller-manager.log" 2>&1 &
    echo "$!" >>"$dir/pids"

    # The serviceaccount controller creates `default` in each namespace: pods need it.
    wait_for 60 "default service account" \
        curl -skf -H "Authorization: Bearer $admin_token" "$server/api/v1/namespaces/default/serviceaccounts/default"

    cat >"$dir/env" <<EOF
KUBECONFIG=$dir/kubeconfig
WRK_K8S_SERVER=$server
WRK_K8S_TOKEN=$admin_token
EOF
    echo "Kubernetes 1.20 control plane up (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)"
    echo "  server:     $server (self-signed; token auth)"
    echo "  kubeconfig: $dir/kubeconfig   e.g. KUBECONFIG=$dir/kubeconfig kubectl get nodes"
    echo "  logs:       $dir/*.log"
    echo "  stop:       $0 stop $dir"
    trap - ERR
}

stop() {
    local dir=$1
    [[ -f "$dir/pids" ]] || { log "nothing recorded in $dir/pids"; return 0; }
    local pid
    # Reverse order: controllers first, etcd last.
    for pid in $(tac "$dir/pids"); do
        kill "$pid" 2>/dev/null || true
    done
    for pid in $(tac "$dir/pids"); do
        for _ in $(seq 1 40); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        kill -9 "$pid" 2>/dev/null || true
    done
    rm -f "$dir/pids"
}

case "${1:-}" in
    build) build ;;
    start)
        [[ $# -eq 2 ]] || { echo "usage: $0 start DIR" >&2; exit 2; }
        start "$2"
        ;;
    stop)
        [[ $# -eq 2 ]] || { echo "usage: $0 stop DIR" >&2; exit 2; }
        stop "$2"
        ;;
    *)
        echo "usage: $0 build | start DIR | stop DIR" >&2
        exit 2
        ;;
esac
