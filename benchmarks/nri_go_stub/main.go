// The anchor koordrp's NRI mode is measured against: a plugin on containerd/nri's own Go stub
// (pkg/stub) that subscribes to the 11 events koordrp subscribes to (koordrp/nri/plugin.py
// SUBSCRIBED) and answers each at once, doing nothing. What it costs a pod start, and its CPU,
// is what a plugin written the way NRI's authors intend pays.
//
//	nri-go-stub --nri-socket PATH [--name gostub] [--index 10] [--verbose]
//
// It prints "ready" once containerd has synchronized it (from then on containerd calls it on
// every pod and container event) and exits when containerd closes the connection. The stub's own
// log lines (registration, configuration) go to stderr with --verbose; else only its warnings.
// scripts/build-go builds it.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sync"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	"github.com/sirupsen/logrus"
)

type plugin struct {
	synchronized sync.Once
}

func (p *plugin) Synchronize(context.Context, []*api.PodSandbox, []*api.Container) ([]*api.ContainerUpdate, error) {
	p.synchronized.Do(func() { fmt.Println("ready") })
	return nil, nil
}

// The 11 events, in koordrp/nri/plugin.py SUBSCRIBED's order: the stub subscribes to those it has a method for.

func (*plugin) RunPodSandbox(context.Context, *api.PodSandbox) error {
	return nil
}

func (*plugin) StopPodSandbox(context.Context, *api.PodSandbox) error {
	return nil
}

func (*plugin) RemovePodSandbox(context.Context, *api.PodSandbox) error {
	return nil
}

func (*plugin) CreateContainer(context.Context, *api.PodSandbox, *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	return nil, nil, nil
}

func (*plugin) PostCreateContainer(context.Context, *api.PodSandbox, *api.Container) error {
	return nil
}

func (*plugin) StartContainer(context.Context, *api.PodSandbox, *api.Container) error {
	return nil
}

func (*plugin) PostStartContainer(context.Context, *api.PodSandbox, *api.Container) error {
	return nil
}

func (*plugin) UpdateContainer(context.Context, *api.PodSandbox, *api.Container, *api.LinuxResources) ([]*api.ContainerUpdate, error) {
	return nil, nil
}

func (*plugin) PostUpdateContainer(context.Context, *api.PodSandbox, *api.Container) error {
	return nil
}

func (*plugin) StopContainer(context.Context, *api.PodSandbox, *api.Container) ([]*api.ContainerUpdate, error) {
	return nil, nil
}

func (*plugin) RemoveContainer(context.Context, *api.PodSandbox, *api.Container) error {
	return nil
}

func main() {
	socket := flag.String("nri-socket", api.DefaultSocketPath, "containerd's NRI socket")
	name := flag.String("name", "gostub", "the plugin name it registers")
	index := flag.String("index", "10", "the plugin index it registers (two digits), as koordrp's --nri-plugin-index")
	verbose := flag.Bool("verbose", false, "log the stub's registration and configuration")
	flag.Parse()
	if !*verbose {
		logrus.SetLevel(logrus.WarnLevel)
	}

	nriStub, err := stub.New(&plugin{}, stub.WithSocketPath(*socket), stub.WithPluginName(*name), stub.WithPluginIdx(*index))
	if err != nil {
		fmt.Fprintf(os.Stderr, "nri-go-stub: %v\n", err)
		os.Exit(1)
	}
	if err := nriStub.Run(context.Background()); err != nil {
		fmt.Fprintf(os.Stderr, "nri-go-stub: %v\n", err)
		os.Exit(1)
	}
}
