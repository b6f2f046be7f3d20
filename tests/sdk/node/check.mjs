// The official `openai` Node SDK, unmodified, against a live tokenmill stack. Every check prints one line,
// `CHECK <name> ok` or `CHECK <name> FAIL <why>`; tests/integration/test_sdk_node.py starts the stack, runs this
// and asserts on the lines. Environment: TOKENMILL_BASE_URL (…/v1), TOKENMILL_API_KEY, TOKENMILL_MODEL, and
// TOKENMILL_SINGLE_KEY (a tenant allowed one request at a time, for the 429-and-retry check).
import assert from "node:assert/strict";
import OpenAI, { AuthenticationError, NotFoundError, toFile } from "openai";
import { LengthFinishReasonError } from "openai/error";
import { zodResponseFormat } from "openai/helpers/zod";
import { z } from "zod";

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const baseURL = env("TOKENMILL_BASE_URL");
const model = env("TOKENMILL_MODEL");
const client = new OpenAI({ baseURL, apiKey: env("TOKENMILL_API_KEY"), maxRetries: 0, timeout: 60_000 });
const user = [{ role: "user", content: "Name a colour." }];

const checks = [];
const check = (name, fn) => checks.push([name, fn]);

check("models.list", async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.ok(ids.includes(model), ids.join(","));
});

check("models.retrieve", async () => {
  const m = await client.models.retrieve(model);
  assert.equal(m.id, model);
  assert.equal(m.object, "model");
  assert.equal(typeof m.created, "number");
});

check("chat.whole", async () => {
  const c = await client.chat.completions.create({ model, messages: user, max_tokens: 6, ignore_eos: true });
  assert.equal(c.object, "chat.completion");
  assert.equal(typeof c.choices[0].message.content, "string");
  assert.equal(c.choices[0].finish_reason, "length");
  assert.equal(c.usage.completion_tokens, 6);
});

check("chat.stream", async () => {
  const args = { model, messages: user, max_tokens: 6, temperature: 0, seed: 5, ignore_eos: true };
  const whole = await client.chat.completions.create(args);
  const stream = await client.chat.completions.create({ ...args, stream: true, stream_options: { include_usage: true } });
  let text = "";
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      text += choice.delta.content ?? "";
      finish = choice.finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, "length");
  assert.equal(usage.completion_tokens, 6);
});

check("chat.n", async () => {
  const c = await client.chat.completions.create({ model, messages: user, max_tokens: 4, n: 2, seed: 1 });
  assert.deepEqual(c.choices.map((x) => x.index).sort(), [0, 1]);
});

check("chat.logprobs", async () => {
  const c = await client.chat.completions.create({ model, messages: user, max_tokens: 4, logprobs: true,
    top_logprobs: 2, ignore_eos: true });
  const content = c.choices[0].logprobs.content;
  assert.equal(content.length, 4);
  for (const t of content) assert.ok(typeof t.logprob === "number" && t.logprob <= 0, JSON.stringify(t));
});

// A random model under a grammar: an answer may run out of tokens before its JSON closes (the SDK then raises
// LengthFinishReasonError rather than parse half an object). A few seeds give answers that end by themselves.
const SEEDS = [0, 1, 2, 3, 4, 5];

check("chat.structured_output", async () => {
  const Colour = z.object({ colour: z.enum(["red", "green", "blue"]), bright: z.boolean() });
  let parsed = 0;
  for (const seed of SEEDS) {
    let c;
    try {
      c = await client.chat.completions.parse({ model, messages: user, max_tokens: 60, seed,
        response_format: zodResponseFormat(Colour, "colour") });
    } catch (err) {
      if (err instanceof LengthFinishReasonError) continue;
      throw err;
    }
    const value = c.choices[0].message.parsed;
    assert.ok(["red", "green", "blue"].includes(value.colour), JSON.stringify(value));
    assert.equal(typeof value.bright, "boolean");
    parsed += 1;
  }
  assert.ok(parsed >= 3, `only ${parsed} of ${SEEDS.length} answers parsed`);
});

check("chat.tool_round_trip", async () => {
  const tools = [{ type: "function", function: { name: "get_weather", parameters: { type: "object",
    additionalProperties: false, required: ["city"], properties: { city: { type: "string", maxLength: 8 } } },
    strict: true } }];
  const messages = [{ role: "user", content: "What is the weather in Oslo?" }];
  for (const seed of SEEDS) {
    const first = await client.chat.completions.create({ model, messages, tools, max_tokens: 60, seed,
      tool_choice: { type: "function", function: { name: "get_weather" } } });
    const choice = first.choices[0];
    if (choice.finish_reason === "length") continue;
    assert.equal(choice.finish_reason, "tool_calls");
    const [call] = choice.message.tool_calls;
    assert.equal(call.type, "function");
    assert.equal(call.function.name, "get_weather");
    assert.equal(typeof JSON.parse(call.function.arguments).city, "string");
    const second = await client.chat.completions.create({ model, tools, max_tokens: 6, messages: [...messages,
      choice.message, { role: "tool", tool_call_id: call.id, content: "12 degrees, cloudy" }] });
    assert.equal(typeof second.choices[0].message.content, "string");
    return;
  }
  assert.fail("no answer finished its tool call");
});

check("responses.create_retrieve_delete", async () => {
  const r = await client.responses.create({ model, input: "Say hi.", instructions: "Be brief.",
    max_output_tokens: 6 });
  assert.equal(r.object, "response");
  assert.ok(["completed", "incomplete"].includes(r.status), r.status);
  assert.equal(typeof r.output_text, "string");
  assert.equal(r.usage.input_tokens_details.cached_tokens >= 0, true);
  const again = await client.responses.retrieve(r.id);
  assert.equal(again.id, r.id);
  assert.equal(again.output_text, r.output_text);
  const next = await client.responses.create({ model, input: "And again.", previous_response_id: r.id,
    max_output_tokens: 4 });
  assert.equal(next.previous_response_id, r.id);
  assert.ok(next.usage.input_tokens > r.usage.input_tokens, "the history is in the second turn's prompt");
  await client.responses.delete(r.id);
  await assert.rejects(client.responses.retrieve(r.id), NotFoundError);
});

check("responses.stream", async () => {
  const stream = client.responses.stream({ model, input: "Say hi.", max_output_tokens: 8 });
  const types = [];
  let deltas = "";
  for await (const event of stream) {
    types.push(event.type);
    if (event.type === "response.output_text.delta") deltas += event.delta;
  }
  const final = await stream.finalResponse();
  assert.equal(types[0], "response.created");
  assert.ok(["response.completed", "response.incomplete"].includes(types.at(-1)), types.at(-1));
  assert.equal(deltas, final.output_text);
});

check("files_and_batches", async () => {
  const lines = [0, 1, 2].map((i) => JSON.stringify({ custom_id: `n${i}`, method: "POST",
    url: "/v1/chat/completions", body: { model, messages: user, max_tokens: 2 } }));
  const file = await client.files.create({ file: await toFile(Buffer.from(lines.join("\n") + "\n"), "node.jsonl"),
    purpose: "batch" });
  assert.equal((await client.files.retrieve(file.id)).filename, "node.jsonl");
  let batch = await client.batches.create({ input_file_id: file.id, endpoint: "/v1/chat/completions",
    completion_window: "24h" });
  const deadline = Date.now() + 60_000;
  while (!["completed", "failed", "cancelled", "expired"].includes(batch.status)) {
    assert.ok(Date.now() < deadline, `batch still ${batch.status}`);
    await new Promise((resolve) => setTimeout(resolve, 300)); // polling, as a client must
    batch = await client.batches.retrieve(batch.id);
  }
  assert.equal(batch.status, "completed");
  assert.equal(batch.request_counts.completed, 3);
  const output = (await (await client.files.content(batch.output_file_id)).text()).trim().split("\n");
  assert.deepEqual(output.map((l) => JSON.parse(l).custom_id).sort(), ["n0", "n1", "n2"]);
  const ids = [];
  for await (const b of client.batches.list()) ids.push(b.id);
  assert.ok(ids.includes(batch.id));
  const deleted = await client.files.delete(file.id);
  assert.equal(deleted.deleted, true);
});

check("error.401_authentication", async () => {
  const bad = new OpenAI({ baseURL, apiKey: "tm-000000000000-nope", maxRetries: 0 });
  await assert.rejects(bad.models.list(), AuthenticationError);
});

check("error.404_model", async () => {
  await assert.rejects(client.chat.completions.create({ model: "no-such-model", messages: user }),
    (err) => err instanceof NotFoundError && err.code === "model_not_found");
});

check("error.429_retried", async () => {
  // The tenant may run one request at a time. One stream holds that slot; a second request is refused with 429
  // and Retry-After, and the SDK retries it by itself. The hold ends when that first 429 has been seen.
  const key = env("TOKENMILL_SINGLE_KEY");
  const holder = new OpenAI({ baseURL, apiKey: key, maxRetries: 0 });
  const hold = await holder.chat.completions.create({ model, messages: user, max_tokens: 1500, ignore_eos: true,
    stream: true });
  const iterator = hold[Symbol.asyncIterator]();
  await iterator.next(); // the held request is running
  const statuses = [];
  const retrying = new OpenAI({ baseURL, apiKey: key, maxRetries: 5, fetch: async (url, init) => {
    const response = await fetch(url, init);
    statuses.push(response.status);
    if (response.status === 429) hold.controller.abort();
    return response;
  } });
  const answer = await retrying.chat.completions.create({ model, messages: user, max_tokens: 2 });
  assert.equal(answer.object, "chat.completion");
  assert.equal(statuses[0], 429, statuses.join(","));
  assert.equal(statuses.at(-1), 200, statuses.join(","));
});

let failed = 0;
for (const [name, fn] of checks) {
  try {
    await fn();
    console.log(`CHECK ${name} ok`);
  } catch (err) {
    failed += 1;
    const why = `${err?.constructor?.name}: ${err?.message}`.replace(/\s+/g, " ").slice(0, 600);
    console.log(`CHECK ${name} FAIL ${why}`);
  }
}
console.log(`DONE ${checks.length - failed}/${checks.length}`);
process.exitCode = failed ? 1 : 0;
