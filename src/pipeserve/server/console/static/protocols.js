// The three generation protocols as the console speaks them: each builds its request
// body from a conversation and turns its stream's events into the same callbacks
// (text, reasoning, tool calls, usage, error). Streams are read as SSE from fetch.
export const PROTOCOLS = {
  "openai-chat": { label: "Chat Completions", sampling: ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"] },
  "anthropic-messages": { label: "Messages", sampling: ["temperature", "top_p", "top_k"] },
  "openai-responses": { label: "Responses", sampling: ["temperature", "top_p", "top_k", "min_p"] },
};

// The request body of one turn. `turns`: [{role, content}], `options`: {model,
// maxTokens, sampling, system, tools, thinking}.
export function requestBody(api, turns, options) {
  const sampling = {};
  for (const name of PROTOCOLS[api].sampling) {
    if (options.sampling[name] !== undefined) sampling[name] = options.sampling[name];
  }
  const tools = options.tools || [];
  if (api === "openai-chat") {
    const messages = options.system ? [{ role: "system", content: options.system }, ...turns] : turns;
    return {
      model: options.model, messages, stream: true, stream_options: { include_usage: true },
      max_tokens: options.maxTokens, ...sampling,
      ...(tools.length ? { tools: tools.map((t) => ({ type: "function", function: t })) } : {}),
    };
  }
  if (api === "anthropic-messages") {
    return {
      model: options.model, messages: turns, stream: true, max_tokens: options.maxTokens, ...sampling,
      ...(options.system ? { system: options.system } : {}),
      ...(options.thinking ? { thinking: { type: "adaptive" } } : {}),
      ...(tools.length ? { tools: tools.map((t) => ({ name: t.name, description: t.description, input_schema: t.parameters || { type: "object" } })) } : {}),
    };
  }
  return {
    model: options.model, input: turns, stream: true, store: false,
    max_output_tokens: options.maxTokens, ...sampling,
    ...(options.system ? { instructions: options.system } : {}),
    ...(options.thinking ? { reasoning: { summary: "auto" } } : {}),
    ...(tools.length ? { tools: tools.map((t) => ({ type: "function", ...t })) } : {}),
  };
}

export function requestHeaders(api) {
  const headers = { "content-type": "application/json" };
  if (api === "anthropic-messages") headers["anthropic-version"] = "2023-06-01";
  return headers;
}

// Read an SSE body, calling on(event, data) for each event with a JSON data line.
export async function readSse(response, on) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      dispatch(block, on);
    }
  }
  if (buffer.trim()) dispatch(buffer, on);
}

function dispatch(block, on) {
  let event = "message";
  const data = [];
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length || data[0] === "[DONE]") return;
  on(event, JSON.parse(data.join("\n")));
}

// A stream event of `api` -> the sink's callbacks: text(t), reasoning(t),
// toolStart(key, name), toolArgs(key, delta), usage({input, output}), error(message).
export function handleEvent(api, event, data, sink) {
  if (api === "openai-chat") return chatEvent(data, sink);
  if (api === "anthropic-messages") return messagesEvent(event, data, sink);
  return responsesEvent(data, sink);
}

function chatEvent(data, sink) {
  if (data.error) return sink.error(data.error.message ?? JSON.stringify(data.error));
  const delta = data.choices?.[0]?.delta ?? {};
  if (delta.reasoning_content) sink.reasoning(delta.reasoning_content);
  if (delta.content) sink.text(delta.content);
  for (const call of delta.tool_calls ?? []) {
    if (call.function?.name) sink.toolStart(call.index, call.function.name);
    if (call.function?.arguments) sink.toolArgs(call.index, call.function.arguments);
  }
  if (data.usage) sink.usage({ input: data.usage.prompt_tokens, output: data.usage.completion_tokens });
}

function messagesEvent(event, data, sink) {
  if (event === "error" || data.type === "error") return sink.error(data.error?.message ?? "error");
  if (data.type === "message_start") sink.usage({ input: data.message?.usage?.input_tokens });
  if (data.type === "content_block_start" && data.content_block?.type === "tool_use") {
    sink.toolStart(data.index, data.content_block.name);
  }
  if (data.type === "content_block_delta") {
    const delta = data.delta ?? {};
    if (delta.type === "text_delta") sink.text(delta.text);
    else if (delta.type === "thinking_delta") sink.reasoning(delta.thinking);
    else if (delta.type === "input_json_delta") sink.toolArgs(data.index, delta.partial_json);
  }
  if (data.type === "message_delta" && data.usage) sink.usage({ output: data.usage.output_tokens });
}

function responsesEvent(data, sink) {
  switch (data.type) {
    case "response.output_text.delta": return sink.text(data.delta);
    case "response.reasoning_text.delta":
    case "response.reasoning_summary_text.delta": return sink.reasoning(data.delta);
    case "response.output_item.added":
      if (data.item?.type === "function_call") sink.toolStart(data.output_index, data.item.name);
      return;
    case "response.function_call_arguments.delta": return sink.toolArgs(data.output_index, data.delta);
    case "response.completed":
    case "response.incomplete": {
      const usage = data.response?.usage;
      if (usage) sink.usage({ input: usage.input_tokens, output: usage.output_tokens });
      return;
    }
    case "response.failed": return sink.error(data.response?.error?.message ?? "response failed");
    case "error": return sink.error(data.message ?? data.error?.message ?? "error");
    default: return;
  }
}
