// A runtime hook server on grpc-go, the library koordlet's own hook server is built on: what koordrp's
// hook client meets on a node, on the wire (HPACK with Huffman coding and its dynamic table, BDP
// PINGs, WINDOW_UPDATEs, SETTINGS, a GOAWAY when it stops), for tests/e2e/test_go_hook_server.py.
//
//	go-hook-server --socket PATH [--answer echo|empty] [--fail CODE] [--delay DURATION]
//	               [--cgroup-parent /koordrp-go-hook] [--cpuset 0]
//
// It serves runtime.v1alpha1.RuntimeHookService on the unix socket PATH (removing whatever is there
// first, as koordlet does) and prints "ready" on stdout once it listens. The server is made as
// koordlet's proxyserver makes its own: grpc.NewServer() with no option, the reflection service
// registered beside the hook service.
//
// There is no generated code: the service is a grpc.ServiceDesc written here, and the codec
// registered as "proto" (the one grpc-go picks for application/grpc) hands each handler the request's
// bytes and sends the answer's bytes as they are. Messages are read and written with protowire.
//
// --answer echo (the default) answers as koordlet does before its plugins change anything: the
// response's fields copied from the request's. The request's bytes themselves would not do: its field
// numbers are not the response's (PodSandboxHookRequest's 2 is runtime_handler, a string, where
// PodSandboxHookResponse's 2 is annotations, a map; ContainerResourceHookRequest's 2 is
// container_meta, where ContainerResourceHookResponse's 2 is container_resources), so each copied
// field is renumbered. Then it changes what koordlet's default plugins change: PreRunPodSandboxHook's
// cgroup_parent becomes --cgroup-parent, and PreCreateContainerHook's and
// PreUpdateContainerResourcesHook's container_resources.cpuset_cpus becomes --cpuset. --answer empty
// answers an empty message, which changes nothing.
//
// --fail CODE answers every call with that gRPC status code (a name, INVALID_ARGUMENT, or a number)
// and a message naming it; --delay waits that long (a Go duration: 500ms, 3s) before answering, or
// until the caller gives up. SIGTERM or SIGINT stops it gracefully (GOAWAY, then the calls in flight
// end; at most 2s), SIGKILL as a crash would. scripts/build-go builds it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

const serviceName = "runtime.v1alpha1.RuntimeHookService"

// Field numbers, from proto/runtime/v1alpha1/api.proto (Koordinator's apis/runtime/v1alpha1/api.proto).
const (
	// PodSandboxHookRequest
	podRequestLabels       protowire.Number = 3
	podRequestAnnotations  protowire.Number = 4
	podRequestCgroupParent protowire.Number = 5
	podRequestResources    protowire.Number = 7
	// PodSandboxHookResponse
	podResponseLabels       protowire.Number = 1
	podResponseAnnotations  protowire.Number = 2
	podResponseCgroupParent protowire.Number = 3
	podResponseResources    protowire.Number = 4
	// ContainerResourceHookRequest
	containerRequestAnnotations  protowire.Number = 3
	containerRequestResources    protowire.Number = 4
	containerRequestCgroupParent protowire.Number = 8
	containerRequestEnvs         protowire.Number = 9
	// ContainerResourceHookResponse
	containerResponseAnnotations  protowire.Number = 1
	containerResponseResources    protowire.Number = 2
	containerResponseCgroupParent protowire.Number = 3
	containerResponseEnvs         protowire.Number = 4
	// LinuxContainerResources
	resourcesCpusetCpus protowire.Number = 6
)

// What koordlet's proxyserver copies from a request into its response, by field number.
var (
	podCopied = map[protowire.Number]protowire.Number{
		podRequestLabels:       podResponseLabels,
		podRequestAnnotations:  podResponseAnnotations,
		podRequestCgroupParent: podResponseCgroupParent,
		podRequestResources:    podResponseResources,
	}
	containerCopied = map[protowire.Number]protowire.Number{
		containerRequestAnnotations:  containerResponseAnnotations,
		containerRequestResources:    containerResponseResources,
		containerRequestCgroupParent: containerResponseCgroupParent,
		containerRequestEnvs:         containerResponseEnvs,
	}
)

// The service's methods, and whether each exchanges PodSandboxHook messages (else ContainerResourceHook ones).
var methods = []struct {
	name string
	pod  bool
}{
	{"PreRunPodSandboxHook", true},
	{"PostStopPodSandboxHook", true},
	{"PreCreateContainerHook", false},
	{"PreStartContainerHook", false},
	{"PostStartContainerHook", false},
	{"PostStopContainerHook", false},
	{"PreUpdateContainerResourcesHook", false},
}

// rawCodec passes the hook service's messages as bytes; the reflection service's are protobuf messages.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

func (rawCodec) Marshal(v any) ([]byte, error) {
	switch message := v.(type) {
	case []byte:
		return message, nil
	case proto.Message:
		return proto.Marshal(message)
	}
	return nil, fmt.Errorf("go-hook-server: cannot marshal a %T", v)
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	switch message := v.(type) {
	case *[]byte:
		*message = data // grpc-go's bridge for this kind of codec hands over a slice of its own
		return nil
	case proto.Message:
		return proto.Unmarshal(data, message)
	}
	return fmt.Errorf("go-hook-server: cannot unmarshal into a %T", v)
}

func init() {
	// Registered under grpc-go's own name for it, this codec replaces grpc-go's protobuf codec
	// without a server option: the server stays as koordlet makes it.
	encoding.RegisterCodec(rawCodec{})
}

type settings struct {
	answer       string
	fail         *codes.Code
	delay        time.Duration
	cgroupParent string
	cpuset       string
}

// copied is the response koordlet starts from: the fields of request that copy names, renumbered; skip
// (0 for none) is a response field left out, since the caller sets it.
func copied(request []byte, copy map[protowire.Number]protowire.Number, skip protowire.Number) ([]byte, error) {
	var response []byte
	for len(request) > 0 {
		number, kind, tagLength := protowire.ConsumeTag(request)
		if tagLength < 0 {
			return nil, protowire.ParseError(tagLength)
		}
		valueLength := protowire.ConsumeFieldValue(number, kind, request[tagLength:])
		if valueLength < 0 {
			return nil, protowire.ParseError(valueLength)
		}
		if to, ok := copy[number]; ok && to != skip {
			response = protowire.AppendTag(response, to, kind)
			response = append(response, request[tagLength:tagLength+valueLength]...)
		}
		request = request[tagLength+valueLength:]
	}
	return response, nil
}

func appendString(message []byte, number protowire.Number, value string) []byte {
	message = protowire.AppendTag(message, number, protowire.BytesType)
	return protowire.AppendString(message, value)
}

// echo is koordlet's answer to method's request: see the comment at the top.
func (s *settings) echo(method string, pod bool, request []byte) ([]byte, error) {
	if pod {
		if method != "PreRunPodSandboxHook" {
			return copied(request, podCopied, 0)
		}
		response, err := copied(request, podCopied, podResponseCgroupParent)
		if err != nil {
			return nil, err
		}
		return appendString(response, podResponseCgroupParent, s.cgroupParent), nil
	}
	response, err := copied(request, containerCopied, 0)
	if err != nil || (method != "PreCreateContainerHook" && method != "PreUpdateContainerResourcesHook") {
		return response, err
	}
	// A second container_resources after the copied one: a protobuf reader merges the two, so this
	// cpuset_cpus, the later, is the one read; the copied resources' other fields stay.
	resources := appendString(nil, resourcesCpusetCpus, s.cpuset)
	response = protowire.AppendTag(response, containerResponseResources, protowire.BytesType)
	return protowire.AppendBytes(response, resources), nil
}

func (s *settings) respond(ctx context.Context, method string, pod bool, request []byte) ([]byte, error) {
	if s.delay > 0 {
		timer := time.NewTimer(s.delay)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	if s.fail != nil {
		return nil, status.Errorf(*s.fail, "go-hook-server fails %s as told (--fail %s)", method, s.fail.String())
	}
	if s.answer == "empty" {
		return []byte{}, nil
	}
	response, err := s.echo(method, pod, request)
	if err != nil {
		// What grpc-go says of a request its protobuf codec cannot read.
		return nil, status.Errorf(codes.Internal, "grpc: error unmarshalling request: %v", err)
	}
	return response, nil
}

func (s *settings) handler(method string, pod bool) grpc.MethodHandler {
	return func(server any, ctx context.Context, decode func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
		var request []byte
		if err := decode(&request); err != nil {
			return nil, err
		}
		respond := func(ctx context.Context, request any) (any, error) {
			return s.respond(ctx, method, pod, request.([]byte))
		}
		if interceptor == nil {
			return respond(ctx, request)
		}
		info := &grpc.UnaryServerInfo{Server: server, FullMethod: "/" + serviceName + "/" + method}
		return interceptor(ctx, request, info, respond)
	}
}

func (s *settings) service() *grpc.ServiceDesc {
	desc := &grpc.ServiceDesc{
		ServiceName: serviceName,
		HandlerType: (*any)(nil), // any handler will do: the methods are closures over s
		Metadata:    "runtime/v1alpha1/api.proto",
	}
	for _, method := range methods {
		desc.Methods = append(desc.Methods, grpc.MethodDesc{MethodName: method.name, Handler: s.handler(method.name, method.pod)})
	}
	return desc
}

func parseCode(text string) (codes.Code, error) {
	var code codes.Code
	// UnmarshalJSON takes a number or a quoted upper-case name, as grpc's service configs write codes.
	if _, err := strconv.ParseUint(text, 10, 32); err != nil {
		text = strconv.Quote(text)
	}
	err := code.UnmarshalJSON([]byte(text))
	return code, err
}

func run() error {
	socket := flag.String("socket", "", "the unix socket to serve on (required)")
	answer := flag.String("answer", "echo", "echo: koordlet's answer, some fields changed; empty: an empty message")
	fail := flag.String("fail", "", "answer every call with this gRPC status code (INVALID_ARGUMENT, or 3)")
	delay := flag.Duration("delay", 0, "wait this long before answering")
	cgroupParent := flag.String("cgroup-parent", "/koordrp-go-hook", "the cgroup_parent PreRunPodSandboxHook answers (echo)")
	cpuset := flag.String("cpuset", "0", "the cpuset_cpus PreCreateContainerHook and PreUpdateContainerResourcesHook answer (echo)")
	flag.Parse()
	if *socket == "" || flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}
	s := &settings{answer: *answer, delay: *delay, cgroupParent: *cgroupParent, cpuset: *cpuset}
	if s.answer != "echo" && s.answer != "empty" {
		return fmt.Errorf("--answer %q: echo or empty", s.answer)
	}
	if *fail != "" {
		code, err := parseCode(*fail)
		if err != nil {
			return fmt.Errorf("--fail %q: %v", *fail, err)
		}
		s.fail = &code
	}

	if err := os.Remove(*socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	listener, err := net.Listen("unix", *socket)
	if err != nil {
		return err
	}
	server := grpc.NewServer()
	server.RegisterService(s.service(), struct{}{})
	reflection.Register(server)

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		// GracefulStop sends GOAWAY and waits for the calls in flight (one held by --delay among them);
		// Stop, after a bound, closes the connections.
		bound := time.AfterFunc(2*time.Second, server.Stop)
		server.GracefulStop()
		bound.Stop()
	}()
	fmt.Println("ready")
	return server.Serve(listener)
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "go-hook-server: %v\n", err)
		os.Exit(1)
	}
}
