#!/usr/bin/env bash
# The deployment files' check, a step of scripts/test.sh: deploy/validate's own tests
# (broken manifests, configuration, Dockerfile and CDI specs that must be refused), then
# the repository's deploy/kubernetes (a kustomize build, every object decoded strictly into
# the k8s.io/api types), deploy/kubernetes/justitiad.toml (against packaging/justitiad.toml,
# and accepted by justitiad --check) and deploy/Dockerfile (BuildKit's parser: no container
# builder is assumed), and a spec from `justitia cdi` for a fake rxe0 through the CDI
# project's validation, then the same spec with a misspelt field, which must be refused.
#
# Needs Go (go.mod's version or newer; /usr/local/go/bin is looked in) and the Go module
# proxy for the first build. CARGO_TARGET_DIR is honoured; the validator is built there.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
command -v go >/dev/null 2>&1 || export PATH="$PATH:/usr/local/go/bin"
if ! command -v go >/dev/null 2>&1; then
  echo "deploy check: no Go toolchain (need $(awk '/^go / {print $2}' deploy/validate/go.mod) or newer on PATH or in /usr/local/go/bin)" >&2
  exit 1
fi
target=${CARGO_TARGET_DIR:-$PWD/target}
validator=$target/deploy-validate
start=$SECONDS
(cd deploy/validate && GOFLAGS=-mod=readonly go build -o "$validator" . && GOFLAGS=-mod=readonly go test -count=1 ./...)
echo "deploy check: validator built and its tests passed in $((SECONDS - start)) s"

"$validator" repo .

cargo build -q --locked -p justitia-cli --bin justitia -p justitia-daemon --bin justitiad
"$target/debug/justitiad" --config deploy/kubernetes/justitiad.toml --check

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/sys/class/infiniband_verbs/uverbs0" "$scratch/sys/class/misc/rdma_cm"
echo rxe0 > "$scratch/sys/class/infiniband_verbs/uverbs0/ibdev"
"$target/debug/justitia" cdi --sysfs "$scratch/sys" --output "$scratch/justitia.json"
"$validator" cdi "$scratch/justitia.json"
sed '0,/"containerPath"/s//"containerpath"/' "$scratch/justitia.json" > "$scratch/broken.json"
if out=$("$validator" cdi "$scratch/broken.json" 2>&1); then
  echo "deploy check: a CDI spec with a misspelt field was accepted: $out" >&2
  exit 1
fi
echo "deploy check: the misspelt spec is refused: $(echo "$out" | tr '\n' ' ' | head -c 300)"
