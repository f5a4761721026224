#!/usr/bin/env bash
# The deployment files' check, a step of scripts/test.sh: the device plugin's tests
# (deploy/device-plugin, against a fake kubelet), deploy/validate's own tests
# (broken manifests, configuration, Dockerfile and CDI specs that must be refused), then
# the repository's deploy/kubernetes (a kustomize build, every object decoded strictly into
# the k8s.io/api types), deploy/kubernetes/justitiad.toml (against packaging/justitiad.toml,
# and accepted by justitiad --check) and deploy/Dockerfile (BuildKit's parser: no container
# builder is assumed), and a spec from `justitia cdi` for a fake rxe0 through the CDI
# project's validation, then the same spec with a misspelt field, which must be refused.
# The spec is also read with each CDI library release the field's runtimes vendor
# (deploy/validate/cdi-readers: podman 4.3.1, containerd 1.7, 2.0, 2.1/2.2, CRI-O 1.34),
# which must resolve its devices; a spec declaring 1.1.0, the version `justitia cdi` once
# wrote whatever its content, must be refused by every one of them.
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
# The validator runs the install step with justitia and has justitiad check the
# ConfigMap's configuration.
cargo build -q --locked -p justitia-cli --bin justitia -p justitia-daemon --bin justitiad
export JUSTITIA_BIN_DIR=$target/debug
start=$SECONDS
# The device plugin (its tests run it against a fake kubelet), built beside them.
(cd deploy/device-plugin && GOFLAGS=-mod=readonly go vet . && GOFLAGS=-mod=readonly go test -count=1 -race . \
  && GOFLAGS=-mod=readonly go build -o "$JUSTITIA_BIN_DIR/justitia-device-plugin" .)
echo "deploy check: device plugin built and its tests passed in $((SECONDS - start)) s"
start=$SECONDS
(cd deploy/validate && GOFLAGS=-mod=readonly go build -o "$validator" . && GOFLAGS=-mod=readonly go test -count=1 ./...)
echo "deploy check: validator built and its tests passed in $((SECONDS - start)) s"

"$validator" repo . "$JUSTITIA_BIN_DIR"
# (justitiad --check on the ConfigMap runs inside the validator, with the pod's own command
# line and the peer channel's key and member list made as the pod and peer-members.sh make them.)

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

# Every runtime's CDI library reads the spec and resolves its devices; each refuses a spec
# declaring a version it does not know (what `justitia cdi` wrote before it declared the
# oldest version its content needs).
"$target/debug/justitia" cdi --sysfs "$scratch/sys" --cdi-version 1.1.0 --output "$scratch/v110.json"
for reader in deploy/validate/cdi-readers/v*/; do
  release=$(basename "$reader")
  (cd "$reader" && GOFLAGS=-mod=readonly go build -o "$target/cdi-read-$release" .)
  "$target/cdi-read-$release" "$scratch/justitia.json" \
    justitia.io/rdma=rxe0 justitia.io/rdma=rxe0-bandwidth justitia.io/rdma=rxe0-unshaped
  if out=$("$target/cdi-read-$release" "$scratch/v110.json" 2>&1); then
    echo "deploy check: CDI $release read a spec declaring 1.1.0, which it cannot know: $out" >&2
    exit 1
  fi
  echo "deploy check: CDI $release refuses the 1.1.0 spec: ${out##*: }"
done
