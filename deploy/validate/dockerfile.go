package main

import (
	"bytes"
	"fmt"
	"slices"
	"strings"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	corev1 "k8s.io/api/core/v1"
)

// checkDockerfile parses a Dockerfile with BuildKit's own parser and instruction reader
// (what `docker build` runs first), with its lint rules as errors, and checks that it is
// multi-stage, that its last stage runs as a user other than root, and that it installs
// the files the DaemonSet runs.
func checkDockerfile(data []byte, o *builtObjects) (string, error) {
	ast, err := parser.Parse(bytes.NewReader(data))
	if err != nil {
		return "", err
	}
	for _, w := range ast.Warnings {
		return "", fmt.Errorf("line %d: %s", w.Location.Start.Line, w.Short)
	}
	var lint []string
	l := linter.New(&linter.Config{Warn: func(rule, _, _, msg string, loc []parser.Range) {
		line := 0
		if len(loc) > 0 {
			line = loc[0].Start.Line
		}
		lint = append(lint, fmt.Sprintf("line %d: %s: %s", line, rule, msg))
	}})
	stages, _, err := instructions.Parse(ast.AST, l)
	if err != nil {
		return "", err
	}
	if len(lint) > 0 {
		return "", fmt.Errorf("%s", strings.Join(lint, "; "))
	}
	if len(stages) < 2 {
		return "", fmt.Errorf("%d stage: the build tools must stay out of the runtime image", len(stages))
	}
	names := map[string]bool{}
	for _, s := range stages {
		names[strings.ToLower(s.Name)] = true
	}
	last := stages[len(stages)-1]
	user := ""
	copied := ""
	for _, cmd := range last.Commands {
		switch c := cmd.(type) {
		case *instructions.UserCommand:
			user = c.User
		case *instructions.CopyCommand:
			if c.From != "" && !names[strings.ToLower(c.From)] {
				return "", fmt.Errorf("COPY --from=%s names no stage", c.From)
			}
		}
	}
	if u, _, _ := strings.Cut(user, ":"); u == "" || u == "0" || u == "root" {
		return "", fmt.Errorf("the runtime stage runs as root (USER %q)", user)
	}
	for _, s := range stages[:len(stages)-1] {
		for _, cmd := range s.Commands {
			if r, ok := cmd.(*instructions.RunCommand); ok {
				copied += strings.Join(r.CmdLine, " ")
			}
		}
	}
	// What the DaemonSet runs must be installed where it looks: the commands it names
	// on PATH (installed to /usr/bin) and the image's files it names under /usr/lib/justitia.
	var wanted []string
	for _, word := range daemonSetWords(o) {
		switch {
		case word == "justitiad" || word == "justitia" || word == "justitia-device-plugin":
			wanted = append(wanted, "/usr/bin/"+word)
		case strings.HasPrefix(word, "/usr/lib/justitia/"):
			wanted = append(wanted, word)
		}
	}
	if len(wanted) == 0 {
		return "", fmt.Errorf("the DaemonSet runs nothing from the image")
	}
	for _, w := range wanted {
		if !strings.Contains(copied, "/out"+w+" ") && !strings.HasSuffix(copied, "/out"+w) {
			return "", fmt.Errorf("the DaemonSet uses %s, which the build stages do not install (as /out%s)", w, w)
		}
	}
	slices.Sort(wanted)
	return fmt.Sprintf("parsed by BuildKit, %d stages, runtime stage %q as USER %s, installs %s",
		len(stages), last.Name, user, strings.Join(slices.Compact(wanted), " ")), nil
}

// daemonSetWords: every word of the DaemonSet's containers' commands, arguments and exec
// probes.
func daemonSetWords(o *builtObjects) []string {
	var words []string
	for _, ds := range o.daemonSets {
		pod := ds.Spec.Template.Spec
		for _, c := range append(append([]corev1.Container(nil), pod.InitContainers...), pod.Containers...) {
			texts := append(append([]string(nil), c.Command...), c.Args...)
			for _, p := range []*corev1.Probe{c.LivenessProbe, c.StartupProbe, c.ReadinessProbe} {
				if p != nil && p.Exec != nil {
					texts = append(texts, p.Exec.Command...)
				}
			}
			for _, t := range texts {
				words = append(words, strings.Fields(t)...)
			}
		}
	}
	return words
}
