//! A streamed chat answer as the Responses API's events: `response.created`,
//! `response.in_progress`, the message's `output_item.added` / `content_part.added` /
//! `output_text.delta`… / `.done`, each function call's `output_item.added` /
//! `function_call_arguments.delta` / `.done` / `output_item.done`, then `response.completed`
//! (or `response.incomplete`) with the usage. A task reads the chat stream and sends the
//! events; when the client goes away the channel closes and the chat stream is dropped (the
//! request is cancelled as any chat stream is).

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive};
use axum::response::{Response, Sse};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::convert::{self, Echo};
use crate::state::AppState;

/// The translation's state.
struct Translate {
    echo: Echo,
    seq: u64,
    output: Vec<Value>,
    /// The message item being written: its id and text so far.
    message: Option<(String, String)>,
    finish: String,
    usage: Value,
    tool_calls: Vec<Value>,
    /// The function call being written: its item and its chat form (arguments so far).
    call: Option<(Value, Value)>,
    tx: mpsc::Sender<SseEvent>,
}

impl Translate {
    async fn send(&mut self, kind: &str, mut data: Value) -> bool {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        let ev = SseEvent::default().event(kind).data(data.to_string());
        self.tx.send(ev).await.is_ok()
    }

    async fn text(&mut self, delta: &str) -> bool {
        if !self.close_call().await {
            return false;
        }
        let index = self.output.len();
        if self.message.is_none() {
            let id = format!("msg_{}", crate::state::fresh_id());
            let mut item = convert::message_item(&id, "", "in_progress");
            item["content"] = json!([]);
            self.message = Some((id.clone(), String::new()));
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            if !self.send("response.output_item.added", json!({"output_index": index, "item": item})).await
                || !self.send("response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part})).await
            {
                return false;
            }
        }
        let (id, text) = self.message.as_mut().expect("opened above");
        text.push_str(delta);
        let id = id.clone();
        self.send("response.output_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": []})).await
    }

    async fn close_message(&mut self) -> bool {
        let Some((id, text)) = self.message.take() else {
            return true;
        };
        let index = self.output.len();
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let item = convert::message_item(&id, &text, self.item_status());
        let ok = self.send("response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []})).await
            && self.send("response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part})).await
            && self.send("response.output_item.done", json!({"output_index": index, "item": item})).await;
        self.output.push(item);
        ok
    }

    /// A function call begins (the chat delta with its id and name): its item is added and
    /// the arguments it came with are its first delta.
    async fn open_call(&mut self, c: &Value) -> bool {
        if !self.close_message().await || !self.close_call().await {
            return false;
        }
        let f = &c["function"];
        let (id, name) = (
            c["id"].as_str().unwrap_or(""),
            f["name"].as_str().unwrap_or(""),
        );
        let item = convert::call_item(id, name, "", "in_progress");
        let mut chat = c.clone();
        chat["function"]["arguments"] = json!("");
        if let Some(o) = chat.as_object_mut() {
            o.remove("index");
        }
        self.call = Some((item.clone(), chat));
        let index = self.output.len();
        self.send(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        )
        .await
            && self.call_args(f["arguments"].as_str().unwrap_or("")).await
    }

    /// More of the open call's arguments.
    async fn call_args(&mut self, delta: &str) -> bool {
        let Some((item, chat)) = self.call.as_mut() else {
            return true;
        };
        if delta.is_empty() {
            return true;
        }
        let args = chat["function"]["arguments"]
            .as_str()
            .unwrap_or("")
            .to_string()
            + delta;
        chat["function"]["arguments"] = json!(args);
        let item_id = item["id"].clone();
        let index = self.output.len();
        self.send(
            "response.function_call_arguments.delta",
            json!({"item_id": item_id, "output_index": index, "delta": delta}),
        )
        .await
    }

    /// An item closed now: cut by `max_output_tokens` if the answer ended so (only the last
    /// item closes after the finish reason came).
    fn item_status(&self) -> &'static str {
        match self.finish.as_str() {
            "length" => "incomplete",
            _ => "completed",
        }
    }

    async fn close_call(&mut self) -> bool {
        let Some((mut item, chat)) = self.call.take() else {
            return true;
        };
        let args = chat["function"]["arguments"].clone();
        item["arguments"] = args.clone();
        item["status"] = json!(self.item_status());
        let index = self.output.len();
        let ok = self
            .send(
                "response.function_call_arguments.done",
                json!({"item_id": item["id"], "output_index": index, "arguments": args}),
            )
            .await
            && self
                .send(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                )
                .await;
        self.output.push(item);
        self.tool_calls.push(chat);
        ok
    }

    /// Translates the chat stream's events as they come; false when the client is gone or
    /// the stream failed.
    async fn relay(&mut self, answer: Response) -> bool {
        let mut body = answer.into_body().into_data_stream();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(Ok(bytes)) = body.next().await {
            buf.extend_from_slice(&bytes);
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                let text = String::from_utf8_lossy(&event);
                for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
                    if data == "[DONE]" {
                        continue;
                    }
                    let Ok(v) = serde_json::from_str::<Value>(data) else {
                        continue;
                    };
                    if !self.chunk(&v).await {
                        return false;
                    }
                }
            }
        }
        self.close_message().await && self.close_call().await
    }

    /// The last event, with the whole response; the conversation kept when `keep`.
    async fn end(&mut self, st: &AppState, conversation: Vec<Value>, keep: bool) {
        let mut r = self.echo.object();
        convert::status(&self.finish, &mut r);
        r["output"] = Value::Array(self.output.clone());
        r["usage"] = self.usage.clone();
        let kind = if r["status"] == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        if keep {
            let text: String = self
                .output
                .iter()
                .filter(|o| o["type"] == "message")
                .filter_map(|o| o["content"][0]["text"].as_str())
                .collect();
            let calls = if self.tool_calls.is_empty() {
                Value::Null
            } else {
                json!(self.tool_calls)
            };
            let said = json!({"role": "assistant", "content": text, "tool_calls": calls});
            st.responses
                .put(&self.echo.id, convert::with_answer(conversation, said));
        }
        self.send(kind, json!({"response": r})).await;
    }

    /// One chat chunk; false when the client is gone or the stream failed.
    async fn chunk(&mut self, v: &Value) -> bool {
        if let Some(e) = v.get("error") {
            let e = json!({"code": e["code"], "message": e["message"], "param": e["param"]});
            self.send("error", e).await;
            return false;
        }
        if !v["usage"].is_null() {
            self.usage = convert::usage(&v["usage"]);
        }
        let Some(c) = v["choices"].get(0) else {
            return true;
        };
        if let Some(t) = c["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
            if !self.text(t).await {
                return false;
            }
        }
        for call in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let ok = match call.get("id") {
                Some(_) => self.open_call(call).await,
                None => {
                    let delta = call["function"]["arguments"].as_str().unwrap_or("");
                    self.call_args(delta).await
                }
            };
            if !ok {
                return false;
            }
        }
        if let Some(f) = c["finish_reason"].as_str() {
            self.finish = f.to_string();
        }
        true
    }
}

/// The events of a streamed answer (see the module notes); the conversation is kept at the end
/// when `keep`.
pub fn events(
    st: Arc<AppState>,
    answer: Response,
    echo: Echo,
    conversation: Vec<Value>,
    keep: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let (tx, mut rx) = mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let mut t = Translate {
            echo,
            seq: 0,
            output: Vec::new(),
            message: None,
            finish: "stop".into(),
            usage: Value::Null,
            tool_calls: Vec::new(),
            call: None,
            tx,
        };
        let start = super::in_progress(&t.echo);
        if !t.send("response.created", json!({"response": start})).await
            || !t
                .send("response.in_progress", json!({"response": start}))
                .await
        {
            return;
        }
        if t.relay(answer).await {
            t.end(&st, conversation, keep).await;
        }
    });
    let events = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)).map(Ok);
    Sse::new(events).keep_alive(KeepAlive::default())
}
