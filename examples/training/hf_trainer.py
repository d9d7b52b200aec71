# transformers' Trainer on kernmap's kernels: kernelize the model, then train as usual.
import sys

from datasets import Dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainingArguments)

import kernmap

model_dir, out_dir = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
print(kernmap.kernelize(model, mode="training"))

texts = [" ".join("abcdefghijklmnopqrstuvwxyz"[(7 * i + j) % 26] * 3 for j in range(6)) for i in range(16)]
data = Dataset.from_dict({"text": texts}).map(lambda e: tokenizer(e["text"]), remove_columns=["text"])
args = TrainingArguments(out_dir, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, use_cpu=True,
                         logging_steps=1, save_strategy="no", report_to=[])
trainer = Trainer(model=model, args=args, train_dataset=data,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
trainer.train()
print("losses", [log["loss"] for log in trainer.state.log_history if "loss" in log])
