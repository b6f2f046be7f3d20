// The official openai-go SDK, unmodified, against a live tokenmill stack. Every check prints one line,
// `CHECK <name> ok` or `CHECK <name> FAIL <why>`; tests/integration/test_sdk_go.py starts the stack, builds and
// runs this and asserts on the lines. Environment: TOKENMILL_BASE_URL (…/v1), TOKENMILL_API_KEY,
// TOKENMILL_MODEL, and TOKENMILL_SINGLE_KEY (a tenant allowed one request at a time, for the 429-and-retry check).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/openai/openai-go/v3/shared"
)

var (
	baseURL = mustEnv("TOKENMILL_BASE_URL")
	model   = mustEnv("TOKENMILL_MODEL")
	client  = openai.NewClient(option.WithBaseURL(baseURL), option.WithAPIKey(mustEnv("TOKENMILL_API_KEY")),
		option.WithMaxRetries(0), option.WithRequestTimeout(60*time.Second))
	ctx   = context.Background()
	user  = []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Name a colour.")}
	seeds = []int64{0, 1, 2, 3, 4, 5}
)

func mustEnv(name string) string {
	value := os.Getenv(name)
	if value == "" {
		fmt.Fprintf(os.Stderr, "%s is not set\n", name)
		os.Exit(2)
	}
	return value
}

func fail(format string, args ...any) error { return fmt.Errorf(format, args...) }

// ignoreEOS is tokenmill's extension (as vLLM has it): the answer runs to max_tokens.
var ignoreEOS = option.WithJSONSet("ignore_eos", true)

func modelsList() error {
	var ids []string
	iter := client.Models.ListAutoPaging(ctx)
	for iter.Next() {
		ids = append(ids, iter.Current().ID)
	}
	if err := iter.Err(); err != nil {
		return err
	}
	if !slices.Contains(ids, model) {
		return fail("%s not among %v", model, ids)
	}
	return nil
}

func modelsRetrieve() error {
	m, err := client.Models.Get(ctx, model)
	if err != nil {
		return err
	}
	if m.ID != model || m.Object != "model" || m.Created == 0 || m.OwnedBy == "" {
		return fail("model %+v", m)
	}
	return nil
}

func chatWhole() error {
	c, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: model, Messages: user,
		MaxTokens: openai.Int(6)}, ignoreEOS)
	if err != nil {
		return err
	}
	if c.Object != "chat.completion" || c.Choices[0].FinishReason != "length" || c.Usage.CompletionTokens != 6 {
		return fail("answer %s", c.RawJSON())
	}
	if !c.Choices[0].Message.JSON.Refusal.Valid() && c.Choices[0].Message.JSON.Refusal.Raw() != "null" {
		return fail("message without refusal: %s", c.Choices[0].Message.RawJSON())
	}
	return nil
}

func chatStream() error {
	params := openai.ChatCompletionNewParams{Model: model, Messages: user, MaxTokens: openai.Int(6),
		Temperature: openai.Float(0), Seed: openai.Int(5)}
	whole, err := client.Chat.Completions.New(ctx, params, ignoreEOS)
	if err != nil {
		return err
	}
	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := client.Chat.Completions.NewStreaming(ctx, params, ignoreEOS)
	defer stream.Close()
	acc := openai.ChatCompletionAccumulator{}
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		return err
	}
	if acc.Choices[0].Message.Content != whole.Choices[0].Message.Content {
		return fail("streamed %q, whole %q", acc.Choices[0].Message.Content, whole.Choices[0].Message.Content)
	}
	if acc.Usage.CompletionTokens != 6 || acc.Choices[0].FinishReason != "length" {
		return fail("streamed usage %+v finish %q", acc.Usage, acc.Choices[0].FinishReason)
	}
	return nil
}

func chatN() error {
	c, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: model, Messages: user,
		MaxTokens: openai.Int(4), N: openai.Int(2), Seed: openai.Int(1)})
	if err != nil {
		return err
	}
	if len(c.Choices) != 2 || c.Choices[0].Index+c.Choices[1].Index != 1 {
		return fail("choices %s", c.RawJSON())
	}
	return nil
}

func chatLogprobs() error {
	c, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: model, Messages: user,
		MaxTokens: openai.Int(4), Logprobs: openai.Bool(true), TopLogprobs: openai.Int(2)}, ignoreEOS)
	if err != nil {
		return err
	}
	content := c.Choices[0].Logprobs.Content
	if len(content) != 4 {
		return fail("%d logprobs for 4 tokens", len(content))
	}
	for _, t := range content {
		if t.Logprob > 0 {
			return fail("logprob %v", t.Logprob)
		}
	}
	return nil
}

// Colour is the typed object a structured answer is decoded into.
type Colour struct {
	Colour string `json:"colour"`
	Bright bool   `json:"bright"`
}

var colourSchema = map[string]any{"type": "object", "additionalProperties": false,
	"required":   []string{"colour", "bright"},
	"properties": map[string]any{"colour": map[string]any{"enum": []string{"red", "green", "blue"}},
		"bright": map[string]any{"type": "boolean"}}}

func chatStructured() error {
	parsed := 0
	for _, seed := range seeds {
		c, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: model, Messages: user,
			MaxTokens: openai.Int(60), Seed: openai.Int(seed),
			ResponseFormat: openai.ChatCompletionNewParamsResponseFormatUnion{
				OfJSONSchema: &shared.ResponseFormatJSONSchemaParam{JSONSchema: shared.ResponseFormatJSONSchemaJSONSchemaParam{
					Name: "colour", Schema: colourSchema, Strict: openai.Bool(true)}}}})
		if err != nil {
			return err
		}
		if c.Choices[0].FinishReason == "length" {
			continue // cut short by max_tokens: its JSON never closed
		}
		var value Colour
		decoder := json.NewDecoder(strings.NewReader(c.Choices[0].Message.Content))
		decoder.DisallowUnknownFields()
		if err := decoder.Decode(&value); err != nil {
			return fail("%v: %q", err, c.Choices[0].Message.Content)
		}
		if !slices.Contains([]string{"red", "green", "blue"}, value.Colour) {
			return fail("colour %q", value.Colour)
		}
		parsed++
	}
	if parsed < 3 {
		return fail("only %d of %d answers parsed", parsed, len(seeds))
	}
	return nil
}

func chatToolRoundTrip() error {
	tool := openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{Name: "get_weather",
		Strict: openai.Bool(true), Parameters: shared.FunctionParameters{"type": "object",
			"additionalProperties": false, "required": []string{"city"},
			"properties": map[string]any{"city": map[string]any{"type": "string", "maxLength": 8}}}})
	messages := []openai.ChatCompletionMessageParamUnion{openai.UserMessage("What is the weather in Oslo?")}
	for _, seed := range seeds {
		first, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: model,
			Messages: messages, Tools: []openai.ChatCompletionToolUnionParam{tool}, MaxTokens: openai.Int(60),
			Seed: openai.Int(seed), ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{
				OfFunctionToolChoice: &openai.ChatCompletionNamedToolChoiceParam{
					Function: openai.ChatCompletionNamedToolChoiceFunctionParam{Name: "get_weather"}}}})
		if err != nil {
			return err
		}
		choice := first.Choices[0]
		if choice.FinishReason == "length" {
			continue
		}
		if choice.FinishReason != "tool_calls" || len(choice.Message.ToolCalls) != 1 {
			return fail("answer %s", first.RawJSON())
		}
		call := choice.Message.ToolCalls[0]
		var args struct {
			City string `json:"city"`
		}
		if err := json.Unmarshal([]byte(call.Function.Arguments), &args); err != nil || call.Function.Name != "get_weather" {
			return fail("call %s: %v", call.RawJSON(), err)
		}
		history := append(slices.Clone(messages), choice.Message.ToParam(),
			openai.ToolMessage("12 degrees, cloudy", call.ID))
		second, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: model,
			Messages: history, Tools: []openai.ChatCompletionToolUnionParam{tool}, MaxTokens: openai.Int(6)})
		if err != nil {
			return err
		}
		if second.Object != "chat.completion" {
			return fail("second turn %s", second.RawJSON())
		}
		return nil
	}
	return fail("no answer finished its tool call")
}

func responsesCreateRetrieveDelete() error {
	first, err := client.Responses.New(ctx, responses.ResponseNewParams{Model: model,
		Input:        responses.ResponseNewParamsInputUnion{OfString: openai.String("Say hi.")},
		Instructions: openai.String("Be brief."), MaxOutputTokens: openai.Int(6)})
	if err != nil {
		return err
	}
	if first.Object != "response" || (first.Status != "completed" && first.Status != "incomplete") {
		return fail("response %s", first.RawJSON())
	}
	again, err := client.Responses.Get(ctx, first.ID, responses.ResponseGetParams{})
	if err != nil {
		return err
	}
	if again.ID != first.ID || again.OutputText() != first.OutputText() {
		return fail("retrieved %s", again.RawJSON())
	}
	next, err := client.Responses.New(ctx, responses.ResponseNewParams{Model: model,
		Input:              responses.ResponseNewParamsInputUnion{OfString: openai.String("And again.")},
		PreviousResponseID: openai.String(first.ID), MaxOutputTokens: openai.Int(4)})
	if err != nil {
		return err
	}
	if next.PreviousResponseID != first.ID || next.Usage.InputTokens <= first.Usage.InputTokens {
		return fail("second turn %s", next.RawJSON())
	}
	if err := client.Responses.Delete(ctx, first.ID); err != nil {
		return err
	}
	_, err = client.Responses.Get(ctx, first.ID, responses.ResponseGetParams{})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound {
		return fail("retrieving a deleted response: %v", err)
	}
	return nil
}

func responsesStream() error {
	stream := client.Responses.NewStreaming(ctx, responses.ResponseNewParams{Model: model,
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Say hi.")}, MaxOutputTokens: openai.Int(8)})
	defer stream.Close()
	var types []string
	var deltas strings.Builder
	var final responses.Response
	for stream.Next() {
		event := stream.Current()
		types = append(types, event.Type)
		switch e := event.AsAny().(type) {
		case responses.ResponseTextDeltaEvent:
			deltas.WriteString(e.Delta)
		case responses.ResponseCompletedEvent:
			final = e.Response
		case responses.ResponseIncompleteEvent:
			final = e.Response
		}
	}
	if err := stream.Err(); err != nil {
		return err
	}
	if types[0] != "response.created" || final.ID == "" || deltas.String() != final.OutputText() {
		return fail("events %v, deltas %q, final %q", types, deltas.String(), final.OutputText())
	}
	return nil
}

func filesAndBatches() error {
	var lines []string
	for i := range 3 {
		line, _ := json.Marshal(map[string]any{"custom_id": fmt.Sprintf("g%d", i), "method": "POST",
			"url": "/v1/chat/completions", "body": map[string]any{"model": model, "max_tokens": 2,
				"messages": []map[string]string{{"role": "user", "content": "Name a colour."}}}})
		lines = append(lines, string(line))
	}
	content := []byte(strings.Join(lines, "\n") + "\n")
	file, err := client.Files.New(ctx, openai.FileNewParams{File: openai.File(bytes.NewReader(content), "go.jsonl",
		"application/jsonl"), Purpose: openai.FilePurposeBatch})
	if err != nil {
		return err
	}
	if got, err := client.Files.Get(ctx, file.ID); err != nil || got.Filename != "go.jsonl" || got.Bytes != int64(len(content)) {
		return fail("file %v %v", got, err)
	}
	batch, err := client.Batches.New(ctx, openai.BatchNewParams{InputFileID: file.ID,
		Endpoint: openai.BatchNewParamsEndpointV1ChatCompletions, CompletionWindow: openai.BatchNewParamsCompletionWindow24h})
	if err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	for !slices.Contains([]string{"completed", "failed", "cancelled", "expired"}, string(batch.Status)) {
		if time.Now().After(deadline) {
			return fail("batch still %s", batch.Status)
		}
		time.Sleep(300 * time.Millisecond) // polling, as a client must
		if batch, err = client.Batches.Get(ctx, batch.ID); err != nil {
			return err
		}
	}
	if batch.Status != "completed" || batch.RequestCounts.Completed != 3 {
		return fail("batch %s", batch.RawJSON())
	}
	output, err := client.Files.Content(ctx, batch.OutputFileID)
	if err != nil {
		return err
	}
	defer output.Body.Close()
	body, _ := io.ReadAll(output.Body)
	if n := len(strings.Split(strings.TrimSpace(string(body)), "\n")); n != 3 {
		return fail("%d output lines", n)
	}
	found := false
	iter := client.Batches.ListAutoPaging(ctx, openai.BatchListParams{})
	for iter.Next() {
		found = found || iter.Current().ID == batch.ID
	}
	if err := iter.Err(); err != nil || !found {
		return fail("batch not listed (%v)", err)
	}
	if deleted, err := client.Files.Delete(ctx, file.ID); err != nil || !deleted.Deleted {
		return fail("delete %v %v", deleted, err)
	}
	return nil
}

func error401() error {
	bad := openai.NewClient(option.WithBaseURL(baseURL), option.WithAPIKey("tm-000000000000-nope"),
		option.WithMaxRetries(0))
	_, err := bad.Models.List(ctx)
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusUnauthorized || apiErr.Type != "authentication_error" {
		return fail("got %v", err)
	}
	return nil
}

func error404Model() error {
	_, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "no-such-model", Messages: user})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound || apiErr.Code != "model_not_found" {
		return fail("got %v", err)
	}
	return nil
}

// error429Retried: the tenant may run one request at a time. One stream holds that slot; a second request is
// refused with 429 and Retry-After, and the SDK retries it by itself. The hold ends when that 429 has been seen.
func error429Retried() error {
	key := mustEnv("TOKENMILL_SINGLE_KEY")
	holdCtx, release := context.WithCancel(ctx)
	defer release()
	holder := openai.NewClient(option.WithBaseURL(baseURL), option.WithAPIKey(key), option.WithMaxRetries(0))
	hold := holder.Chat.Completions.NewStreaming(holdCtx, openai.ChatCompletionNewParams{Model: model,
		Messages: user, MaxTokens: openai.Int(1500)}, ignoreEOS)
	defer hold.Close()
	if !hold.Next() { // the held request is running
		return fail("the holding stream gave nothing: %v", hold.Err())
	}
	var mu sync.Mutex
	var statuses []int
	observe := func(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
		res, err := next(req)
		if err == nil {
			mu.Lock()
			statuses = append(statuses, res.StatusCode)
			mu.Unlock()
			if res.StatusCode == http.StatusTooManyRequests {
				release()
			}
		}
		return res, err
	}
	retrying := openai.NewClient(option.WithBaseURL(baseURL), option.WithAPIKey(key), option.WithMaxRetries(5),
		option.WithMiddleware(observe))
	answer, err := retrying.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: model, Messages: user,
		MaxTokens: openai.Int(2)})
	if err != nil {
		return fail("%v after %v", err, statuses)
	}
	if answer.Object != "chat.completion" || len(statuses) < 2 || statuses[0] != 429 || statuses[len(statuses)-1] != 200 {
		return fail("statuses %v", statuses)
	}
	return nil
}

func main() {
	checks := []struct {
		name string
		run  func() error
	}{
		{"models.list", modelsList}, {"models.retrieve", modelsRetrieve}, {"chat.whole", chatWhole},
		{"chat.stream", chatStream}, {"chat.n", chatN}, {"chat.logprobs", chatLogprobs},
		{"chat.structured_output", chatStructured}, {"chat.tool_round_trip", chatToolRoundTrip},
		{"responses.create_retrieve_delete", responsesCreateRetrieveDelete}, {"responses.stream", responsesStream},
		{"files_and_batches", filesAndBatches}, {"error.401_authentication", error401},
		{"error.404_model", error404Model}, {"error.429_retried", error429Retried},
	}
	failed := 0
	for _, c := range checks {
		err := func() (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fail("panic: %v", r)
				}
			}()
			return c.run()
		}()
		if err != nil {
			failed++
			fmt.Printf("CHECK %s FAIL %s\n", c.name, strings.Join(strings.Fields(err.Error()), " "))
		} else {
			fmt.Printf("CHECK %s ok\n", c.name)
		}
	}
	fmt.Printf("DONE %d/%d\n", len(checks)-failed, len(checks))
	if failed > 0 {
		os.Exit(1)
	}
}
