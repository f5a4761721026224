package main

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/google/cel-go/cel"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// checkAdmission checks the admission policy that keeps the unshaped pool to justitiad and
// the namespaces an operator allows: one policy, bound with Deny, failing closed, on pod
// creation; and, by evaluating its CEL expressions (the cel-go library the API server
// uses) on pods, that it admits justitiad's pod as the DaemonSet makes it and a pod asking
// for the shaped pool, and refuses the unshaped pool and justitia.io/rdma CDI annotations
// everywhere else.
func checkAdmission(o *builtObjects, daemonDS *appsv1.DaemonSet, plugin *pluginSettings) error {
	if len(o.policies) != 1 || len(o.bindings) != 1 {
		return fmt.Errorf("%d ValidatingAdmissionPolicies and %d bindings, expected 1 and 1", len(o.policies), len(o.bindings))
	}
	policy, binding := o.policies[0], o.bindings[0]
	if binding.Spec.PolicyName != policy.Name {
		return fmt.Errorf("the binding names policy %q, but the policy is %q", binding.Spec.PolicyName, policy.Name)
	}
	if !slices.Contains(binding.Spec.ValidationActions, admissionv1.Deny) {
		return fmt.Errorf("the binding's validationActions %v do not deny", binding.Spec.ValidationActions)
	}
	if policy.Spec.FailurePolicy == nil || *policy.Spec.FailurePolicy != admissionv1.Fail {
		return fmt.Errorf("the policy's failurePolicy must be Fail: an expression that cannot be evaluated would let the pod in")
	}
	mc := policy.Spec.MatchConstraints
	covers := mc != nil && slices.ContainsFunc(mc.ResourceRules, func(r admissionv1.NamedRuleWithOperations) bool {
		return slices.Contains(r.Resources, "pods") && slices.Contains(r.APIGroups, "") &&
			(slices.Contains(r.Operations, admissionv1.Create) || slices.Contains(r.Operations, admissionv1.OperationAll))
	})
	if !covers {
		return fmt.Errorf("the policy does not match the creation of pods")
	}
	eval, err := compilePolicy(policy)
	if err != nil {
		return err
	}
	daemonPod := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "justitiad-x", Namespace: daemonDS.Namespace}, Spec: daemonDS.Spec.Template.Spec}
	cases := []struct {
		what      string
		pod       corev1.Pod
		labels    map[string]string
		admit     bool
		mechanism string
	}{
		{"justitiad's pod", daemonPod, nil, true, "the exemption of justitiad's service account"},
		{"a pod asking for " + plugin.resource, podAsking("team-a", plugin.resource, false, nil), nil, true, "the shaped pool"},
		{"a pod asking for " + plugin.unshapedResource, podAsking("team-a", plugin.unshapedResource, false, nil), nil, false, "the unshaped pool's resource name"},
		{"an init container asking for " + plugin.unshapedResource, podAsking("team-a", plugin.unshapedResource, true, nil), nil, false, "init containers"},
		{"a pod in kube-system under another account asking for " + plugin.unshapedResource, podAsking(daemonDS.Namespace, plugin.unshapedResource, false, nil), nil, false, "the service account's name"},
		{"a pod asking for " + plugin.unshapedResource + " in a namespace labelled justitia.io/unshaped=allowed", podAsking("team-b", plugin.unshapedResource, false, nil), map[string]string{"justitia.io/unshaped": "allowed"}, true, "the namespace label"},
		{"a pod with a cdi.k8s.io annotation naming an unshaped device", podAsking("team-a", plugin.resource, false, map[string]string{"cdi.k8s.io/mine": "justitia.io/rdma=rxe0-unshaped"}), nil, false, "CDI annotations"},
		{"a pod with a cdi.k8s.io annotation naming another vendor's device", podAsking("team-a", plugin.resource, false, map[string]string{"cdi.k8s.io/gpu": "vendor.example/gpu=0"}), nil, true, "CDI annotations of other devices"},
	}
	for _, c := range cases {
		admitted, msg, err := eval(c.pod, c.labels)
		if err != nil {
			return fmt.Errorf("the admission policy on %s: %w", c.what, err)
		}
		if admitted != c.admit {
			verb := "refuses"
			if admitted {
				verb = "admits"
			}
			return fmt.Errorf("the admission policy %s %s (%s): check %s", verb, c.what, msg, c.mechanism)
		}
	}
	return nil
}

// podAsking is a pod in namespace ns whose one container (or init container) limits one
// unit of resource, with annotations.
func podAsking(ns, res string, init bool, annotations map[string]string) corev1.Pod {
	c := corev1.Container{Name: "app", Image: "app", Resources: corev1.ResourceRequirements{
		Limits: corev1.ResourceList{corev1.ResourceName(res): resource.MustParse("1")},
	}}
	pod := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: ns, Annotations: annotations}}
	pod.Spec.Containers = []corev1.Container{{Name: "main", Image: "app"}}
	if init {
		pod.Spec.InitContainers = []corev1.Container{c}
	} else {
		pod.Spec.Containers = []corev1.Container{c}
	}
	return pod
}

// policyEval says whether a policy admits a pod in a namespace with the given labels, and
// the message of the validation that refused it.
type policyEval func(pod corev1.Pod, nsLabels map[string]string) (bool, string, error)

// compilePolicy compiles the policy's variables and validations with the variables the API
// server gives them (object, namespaceObject, request, variables).
func compilePolicy(p admissionv1.ValidatingAdmissionPolicy) (policyEval, error) {
	env, err := cel.NewEnv(
		cel.Variable("object", cel.DynType),
		cel.Variable("oldObject", cel.DynType),
		cel.Variable("namespaceObject", cel.DynType),
		cel.Variable("request", cel.DynType),
		cel.Variable("variables", cel.DynType),
	)
	if err != nil {
		return nil, err
	}
	compile := func(what, expr string) (cel.Program, error) {
		ast, issues := env.Compile(expr)
		if issues != nil && issues.Err() != nil {
			return nil, fmt.Errorf("the admission policy's %s does not compile: %w", what, issues.Err())
		}
		return env.Program(ast)
	}
	type named struct {
		name, message string
		prog          cel.Program
	}
	var variables, validations []named
	for _, v := range p.Spec.Variables {
		prog, err := compile("variable "+v.Name, v.Expression)
		if err != nil {
			return nil, err
		}
		variables = append(variables, named{name: v.Name, prog: prog})
	}
	for i, v := range p.Spec.Validations {
		prog, err := compile(fmt.Sprintf("validation %d", i+1), v.Expression)
		if err != nil {
			return nil, err
		}
		validations = append(validations, named{message: v.Message, prog: prog})
	}
	if len(validations) == 0 {
		return nil, fmt.Errorf("the admission policy has no validations")
	}
	return func(pod corev1.Pod, nsLabels map[string]string) (bool, string, error) {
		object, err := asMap(pod)
		if err != nil {
			return false, "", err
		}
		ns := map[string]any{"metadata": map[string]any{"name": pod.Namespace}}
		if nsLabels != nil {
			labels := map[string]any{}
			for k, v := range nsLabels {
				labels[k] = v
			}
			ns["metadata"].(map[string]any)["labels"] = labels
		}
		vars := map[string]any{}
		act := map[string]any{
			"object": object, "oldObject": nil, "namespaceObject": ns,
			"request": map[string]any{"operation": "CREATE", "namespace": pod.Namespace}, "variables": vars,
		}
		for _, v := range variables {
			out, _, err := v.prog.Eval(act)
			if err != nil {
				return false, "", fmt.Errorf("variable %s: %w", v.name, err)
			}
			vars[v.name] = out.Value()
		}
		for _, v := range validations {
			out, _, err := v.prog.Eval(act)
			if err != nil {
				return false, "", fmt.Errorf("validation %q: %w", v.message, err)
			}
			ok, isBool := out.Value().(bool)
			if !isBool {
				return false, "", fmt.Errorf("validation %q gives %v, not a bool", v.message, out.Value())
			}
			if !ok {
				return false, v.message, nil
			}
		}
		return true, "admitted", nil
	}, nil
}

// asMap is an API object as the API server hands it to CEL: its JSON form.
func asMap(obj any) (map[string]any, error) {
	data, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	var m map[string]any
	err = json.Unmarshal(data, &m)
	if m == nil && err == nil {
		err = fmt.Errorf("%s is not an object", strings.TrimSpace(string(data)))
	}
	return m, err
}
