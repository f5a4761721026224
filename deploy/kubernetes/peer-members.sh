#!/bin/sh
# Renders the peer channel's member list from the running justitiad pods and applies it as
# the ConfigMap justitia-peer-members (key members.toml), which every justitiad reads
# within a second of kubelet updating its volume:
#
#   deploy/kubernetes/peer-members.sh            # render and apply (namespace kube-system)
#   deploy/kubernetes/peer-members.sh --print    # render to stdout only
#   NAMESPACE=justitia deploy/kubernetes/peer-members.sh
#
# Each node is named by its pod's status.hostIP (the address justitiad's --peer-node is
# given) and listed with the public key its pod's peer-key step wrote into that step's
# termination message. Run it after installing, and after a node is added, removed, or
# given a new key. It refuses to apply a list in which two pods claim one address or one
# key, or that is empty; pods that have not published a key yet are left out (named on
# stderr): run it again once they run. It needs get on pods, and create and patch on
# ConfigMaps, in the namespace; nothing in the cluster runs it.
set -eu
namespace=${NAMESPACE:-kube-system}
print=no
case "${1:-}" in
  --print) print=yes ;;
  "") ;;
  *) echo "usage: $0 [--print]" >&2; exit 2 ;;
esac
list=$(mktemp)
trap 'rm -f "$list"' EXIT
kubectl -n "$namespace" get pods -l app.kubernetes.io/name=justitiad -o \
  jsonpath='{range .items[*]}{.status.hostIP}{" "}{.status.initContainerStatuses[?(@.name=="peer-key")].state.terminated.message}{"\n"}{end}' |
  awk '
    NF == 0 { next }
    NF == 1 { print "peer-members: the pod on " $1 " has not published its key yet: left out" > "/dev/stderr"; next }
    {
      ip = $1; key = $2
      if (NF != 2 || ip !~ /^([0-9]+\.[0-9]+\.[0-9]+\.[0-9]+|[0-9a-fA-F:]+)$/ || key !~ /^[A-Za-z0-9+\/]+=*$/ || length(key) != 44) {
        print "peer-members: unreadable entry: " $0 > "/dev/stderr"; bad = 1; next
      }
      if (ip in byip) { print "peer-members: two pods claim address " ip > "/dev/stderr"; bad = 1 }
      if (key in bykey) { print "peer-members: " ip " and " bykey[key] " publish one key" > "/dev/stderr"; bad = 1 }
      byip[ip] = key; bykey[key] = ip; n++
    }
    END {
      if (bad) exit 1
      if (n == 0) { print "peer-members: no justitiad pod has published a key" > "/dev/stderr"; exit 1 }
      print "# Rendered by deploy/kubernetes/peer-members.sh: each node'"'"'s address (its pod'"'"'s status.hostIP)"
      print "# and the public key its peer-key step made. " n " members."
      for (ip in byip) printf "\"%s\" = \"%s\"\n", ip, byip[ip]
    }
  ' > "$list"
if [ "$print" = yes ]; then
  cat "$list"
  exit 0
fi
kubectl -n "$namespace" create configmap justitia-peer-members --from-file=members.toml="$list" \
  --dry-run=client -o yaml | kubectl -n "$namespace" apply -f -
echo "peer-members: $(grep -c '^"' "$list") members applied to ConfigMap $namespace/justitia-peer-members" >&2
