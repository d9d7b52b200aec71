# TRL's SFTTrainer on kernmap's kernels: the loss on the completions only, as in supervised fine-tuning.
import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import kernmap

model_dir, out_dir = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
print(kernmap.kernelize(model, mode="training"))

words = ["abcdefghijklmnopqrstuvwxyz"[(5 * i) % 26] * 2 for i in range(96)]
data = Dataset.from_dict({"prompt": [" ".join(words[i:i + 6]) for i in range(0, 96, 6)],
                          "completion": [" " + " ".join(words[i + 6:i + 12]) for i in range(0, 96, 6)]})
args = SFTConfig(out_dir, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, use_cpu=True,
                 logging_steps=1, save_strategy="no", report_to=[])
trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
trainer.train()
print("losses", [log["loss"] for log in trainer.state.log_history if "loss" in log])
