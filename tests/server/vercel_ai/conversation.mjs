// The Vercel AI SDK (ai 7, @ai-sdk/openai 4) with default settings against a pipeserve
// Responses endpoint: a streamed two-turn chat and a generateText tool loop. The replay
// model's script for each request goes in the X-Mock-Response header, chosen from what
// the request carries. Prints JSON: the answers and every exchange (request body, mock,
// the output item ids of the answer), which tests/server/fixtures records for replay.
// Several comma-separated base URLs (servers sharing one store): requests alternate
// between them, so each turn lands on another server than the one that stored the last.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, isStepCount, jsonSchema, streamText, tool } from "ai";

const [bases, model] = process.argv.slice(2);
const servers = bases.split(",");
const base = servers[0];
const THINK = (text) => `<think>\nLet me think.\n</think>\n\n${text}`;
const CALL =
  '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>';
const exchanges = [];

function mockFor(body) {
  const input = JSON.stringify(body.input);
  if (input.includes("function_call_output")) return THINK("It is sunny in Paris.");
  if (body.tools) return CALL;
  return input.includes("What is my name") ? THINK("Your name is Ada.") : THINK("Hello Ada!");
}

async function outputIds(response) {
  const text = await response.clone().text();
  const final = text.startsWith("{")
    ? JSON.parse(text)
    : JSON.parse(text.split("\n").filter((l) => l.includes('"response.completed"')).pop().slice(6)).response;
  return final.output.map((item) => item.id);
}

const openai = createOpenAI({
  baseURL: `${base}/v1`,
  apiKey: "unused",
  fetch: async (url, init) => {
    const body = JSON.parse(init.body);
    const mock = mockFor(body);
    const headers = new Headers(init.headers);
    headers.set("x-mock-response", JSON.stringify(mock));
    const server = servers[exchanges.length % servers.length];
    const response = await fetch(String(url).replace(base, server), { ...init, headers });
    const exchange = { body: init.body, mock, status: response.status, server };
    exchanges.push(exchange);
    exchange.output_ids = response.ok ? await outputIds(response) : [];
    if (!response.ok) exchange.error = await response.clone().text();
    return response;
  },
});

// A chat: streamed turns, the history kept as the SDK keeps it.
const messages = [{ role: "user", content: "Hi, I am Ada." }];
const first = streamText({ model: openai(model), messages });
const firstText = await first.text;
messages.push(...(await first.response).messages, { role: "user", content: "What is my name?" });
const second = streamText({ model: openai(model), messages });
const secondText = await second.text;

// A tool loop: the tool result goes back with the call (and reasoning) by reference.
const loop = await generateText({
  model: openai.responses(model),
  prompt: "Weather in Paris?",
  tools: {
    get_weather: tool({
      description: "Weather for a city",
      inputSchema: jsonSchema({ type: "object", properties: { city: { type: "string" } }, required: ["city"] }),
      execute: async ({ city }) => ({ city, sky: "sunny" }),
    }),
  },
  stopWhen: isStepCount(3),
});

console.log(JSON.stringify({ answers: [firstText, secondText, loop.text], steps: loop.steps.length, exchanges }));
