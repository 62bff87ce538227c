// shmgrad._C.StepParticipant: the worker side of the step protocol for eager Python
// workers (python/shmgrad/_eager_worker.py). The protocol itself is
// worker/step_protocol.cc, shared with the TorchScript worker; Python supplies only the
// compute phase, called with the GIL held while everything else runs without it.
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/trainer.h"
#include "ipc/error.h"
#include "ipc/layout.h"
#include "ipc/reduce.h"
#include "ipc/segment.h"
#include "views/segment_views.h"
#include "worker/direct_linear.h"
#include "worker/grad_hooks.h"
#include "worker/process.h"
#include "worker/replica.h"
#include "worker/step_protocol.h"
#include "worker/worker_loop.h"

namespace py = pybind11;

namespace shmgrad {
namespace {

// A shard as Python sees it. Its tensors view the segment and are valid during the
// compute call only.
struct PyShard {
  int64_t begin = 0, end = 0;
  uint32_t epoch = 0, rank = 0, participants = 0;
  int64_t max_examples_per_pass = 0;
  float grad_scale = 1.0f;
  bool grads_in_reduced = false;  // this worker is alone: .grad must view the reduced buffer
  uint64_t seed = 0;
  bool train = true;
  ipc::BatchKind kind = ipc::BatchKind::kIndices;  // bound as _C.BatchKind
  torch::Tensor indices, inputs, targets;
  std::vector<torch::Tensor> leaves;  // structured: the batch's tensors, this shard's rows
  std::string structure;              // structured: how they nest (python/shmgrad/_batch.py)
};

// The common pass without the runner's Python around it (ShardRunner._use_plain_pass):
// loss(model(inputs), targets) for a shard of explicit inputs and targets, or of indices
// into the dataset the segment holds, where the loss's reduction is known and nothing
// else (a forward=, a device, a structured batch) is involved. The model and the loss
// are still the job's Python callables; the batch's rows, the scale, backward and the
// loss's value are taken here, as ShardRunner._compute_pass takes them.
struct PlainPass {
  py::object model, loss;
  py::object finish;    // finish(out, examples, shard): what a loss that is not one tensor
                        // gets (ShardRunner._finish_pass): (loss sum, count), or an error pair
  py::object describe;  // describe(exc) -> text (_eager_worker.describe)
  bool mean = false;    // the loss is the mean over its examples
  torch::Tensor data_inputs, data_targets;  // the segment's dataset (undefined: none)
};

// Calls the Python compute functions: begin(shard) once per shard, then
// compute_pass(shard, begin, end) per pass (the protocol makes the passes). A pass returns
// (loss sum, count) as floats, or a (type, text) pair of strings describing an exception
// it caught (text: message and traceback); begin returns None or such a pair.
class PyShardComputer : public worker::ShardComputer {
 public:
  // in_trainer: the trainer's own compute (EagerParticipant::runInTrainer sets the threads
  // around each step instead of the shard's placement setting them for good).
  PyShardComputer(py::function begin, py::function pass, py::function publish,
                  py::function unreached, const ipc::Segment& seg, bool in_trainer = false)
      : begin_(std::move(begin)),
        pass_(std::move(pass)),
        publish_(std::move(publish)),
        unreached_(std::move(unreached)),
        seg_(seg),
        threads_(seg.header()->threads_per_worker),
        in_trainer_(in_trainer) {}

  // The model's parameters (the engine's, in order), where the worker watches them on the
  // host (EagerParticipant::watchGradients): then the shard's begin and end need Python
  // only when its bindings or mode change (beginShard), and the parameters backward did
  // not reach are found here, from their .grad's version counters (autograd adds to a
  // defined .grad in place, bumping it), as ShardRunner.unreached finds them.
  void trackParams(const std::vector<torch::Tensor>* params) {
    params_ = params;
    begun_ = false;
  }

  // unreached() lists the parameters backward did not reach in the shard (by index;
  // usually none): every other one is marked.
  void markGradParams(uint64_t* bits, uint32_t num_params) override {
    worker::ShardComputer::markGradParams(bits, num_params);
    if (params_ != nullptr && versions_.size() == params_->size()) {
      for (size_t i = 0; i < versions_.size() && i < num_params; ++i) {
        const torch::Tensor& g = (*params_)[i].grad();
        if (!g.defined() || g._version() == versions_[i]) {
          ipc::clearParamBit(bits, static_cast<uint32_t>(i));
        }
      }
      return;
    }
    py::gil_scoped_acquire gil;
    for (py::handle h : call(unreached_).cast<py::list>()) {
      const int64_t i = h.cast<int64_t>();
      SHMGRAD_CHECK(i >= 0 && i < num_params, ErrorKind::kInvalidArgument, "parameter index ", i,
                    " is out of range: the model has ", num_params);
      ipc::clearParamBit(bits, static_cast<uint32_t>(i));
    }
  }

  void publishBuffers(uint8_t* dst) override {
    py::gil_scoped_acquire gil;
    try {
      publish_(dst != seg_.buffers());  // False: the shared buffers; True: this slot's copy
    } catch (py::error_already_set& e) {
      throw worker::ShardError(py::str(e.type().attr("__name__")).cast<std::string>(), e.what());
    }
  }

  void beginShard(const worker::Shard& s) override {
    if (!in_trainer_) threads_.apply(s.threads);
    shard_ = PyShard();
    shard_.begin = s.begin;
    shard_.end = s.end;
    shard_.epoch = s.epoch;
    shard_.rank = s.rank;
    shard_.participants = s.participants;
    shard_.max_examples_per_pass = s.max_examples_per_pass;
    shard_.grad_scale = s.grad_scale;
    shard_.grads_in_reduced = s.alone;
    shard_.seed = s.seed;
    shard_.train = s.train;
    if (s.kind == ipc::BatchKind::kIndices) {
      shard_.kind = ipc::BatchKind::kIndices;
      shard_.indices = torch::from_blob(const_cast<int64_t*>(s.indices), {s.size()}, torch::kInt64);
    } else if (s.kind == ipc::BatchKind::kStructured) {
      shard_.kind = ipc::BatchKind::kStructured;
      shard_.structure = s.structure;
      for (uint32_t k = 0; k < s.num_leaves; ++k) {
        shard_.leaves.push_back(views::leafView(s.leaf_data[k], s.size(), s.leaves[k]));
      }
    } else {
      shard_.kind = ipc::BatchKind::kExplicit;
      shard_.inputs = views::examplesView(s.inputs, s.size(), *s.example_shape, s.input_dtype);
      shard_.targets = views::examplesView(s.targets, s.size(), *s.target_shape, s.target_dtype);
    }
    // begin() binds .grad to the slot or the reduced buffer (by `alone`), sets the model's
    // mode and loads the shared buffers: with the parameters tracked here, called only
    // when one of those has something to do.
    const bool python_begin = params_ == nullptr || !begun_ || s.alone != last_alone_ ||
                              s.train != last_train_ || seg_.header()->num_buffers > 0;
    if (python_begin) {
      py::gil_scoped_acquire gil;
      call(begin_, py::cast(&shard_, py::return_value_policy::reference));
      begun_ = true;
      last_alone_ = s.alone;
      last_train_ = s.train;
    }
    if (params_ != nullptr) {
      versions_.resize(params_->size());
      for (size_t i = 0; i < params_->size(); ++i) {
        const torch::Tensor& g = (*params_)[i].grad();
        versions_[i] = g.defined() ? g._version() : 0;
      }
    }
  }

  // The participant's plain pass (EagerParticipant::setPlainPass), read at each pass.
  void usePlainPass(const std::unique_ptr<PlainPass>* plain) { plain_ = plain; }

  worker::PassResult computePass(const worker::Shard&, int64_t begin, int64_t end) override {
    if (plain_ != nullptr && *plain_ != nullptr &&
        (shard_.kind == ipc::BatchKind::kExplicit ||
         (shard_.kind == ipc::BatchKind::kIndices && (*plain_)->data_inputs.defined()))) {
      return plainPass(**plain_, begin, end);
    }
    py::gil_scoped_acquire gil;
    auto t = call(pass_, py::cast(&shard_, py::return_value_policy::reference), begin, end)
                 .cast<py::tuple>();
    return {t[0].cast<double>(), t[1].cast<double>()};
  }

 private:
  // ShardRunner._compute_pass's common case (PlainPass), the same operations in the same
  // order: the pass's rows, loss(model(x), y), backward of the loss times its scale, and
  // (the loss's value times the examples of a mean, the examples).
  worker::PassResult plainPass(const PlainPass& plain, int64_t begin, int64_t end) {
    const int64_t examples = end - begin;
    torch::Tensor loss;
    double count = 0, per_example = 1.0;  // per_example: what makes a mean the pass's sum
    {
      py::gil_scoped_acquire gil;
      torch::Tensor x, y;
      if (shard_.kind == ipc::BatchKind::kExplicit) {
        const bool whole = begin == 0 && end == shard_.end - shard_.begin;
        x = whole ? shard_.inputs : shard_.inputs.slice(0, begin, end);
        y = whole ? shard_.targets : shard_.targets.slice(0, begin, end);
      } else {
        const torch::Tensor idx = shard_.indices.slice(0, begin, end);
        x = plain.data_inputs.index_select(0, idx);
        y = plain.data_targets.index_select(0, idx);
      }
      py::object out;
      try {
        out = plain.loss(plain.model(x), y);
      } catch (py::error_already_set& e) {
        // Its traceback travels beside the exception in C++: describe() reads it from
        // __traceback__.
        py::object exc = e.value().attr("with_traceback")(e.trace());
        throw worker::ShardError(py::str(e.type().attr("__name__")).cast<std::string>(),
                                 plain.describe(exc).cast<std::string>());
      }
      // The loss (its mean over the examples, or its sum), or (loss_sum, count) (a mean
      // over counts: _losses.CountedClassLoss returns that for nn.CrossEntropyLoss()).
      PyObject* o = out.ptr();
      PyObject* count_obj = nullptr;
      if (PyTuple_CheckExact(o) && PyTuple_GET_SIZE(o) == 2) {
        count_obj = PyTuple_GET_ITEM(o, 1);
        o = PyTuple_GET_ITEM(o, 0);
      }
      const bool plain_count =
          count_obj == nullptr ||
          (THPVariable_CheckExact(count_obj) && THPVariable_Unpack(count_obj).numel() == 1) ||
          PyFloat_CheckExact(count_obj) || PyLong_CheckExact(count_obj);
      if (!plain_count || !THPVariable_CheckExact(o) || THPVariable_Unpack(o).numel() != 1) {
        // Not a loss, or one this does not know: the runner's Python says what it is.
        auto t =
            call(plain.finish, out, examples, py::cast(&shard_, py::return_value_policy::reference))
                .cast<py::tuple>();
        return {t[0].cast<double>(), t[1].cast<double>()};
      }
      loss = THPVariable_Unpack(o);
      if (count_obj == nullptr) {
        count = static_cast<double>(examples);
        per_example = plain.mean ? static_cast<double>(examples) : 1.0;
      } else {
        count = THPVariable_CheckExact(count_obj) ? THPVariable_Unpack(count_obj).item<double>()
                                                  : py::handle(count_obj).cast<double>();
      }
    }
    const double scale = per_example * static_cast<double>(shard_.grad_scale);
    try {
      // Without the GIL, as Python's backward runs (hooks in Python take it).
      torch::autograd::backward({scale != 1.0 ? loss * scale : loss});
    } catch (const std::exception& e) {
      throw worker::ShardError("RuntimeError", e.what());
    }
    return {loss.item<double>() * per_example, count};
  }

  // Calls fn; a returned (type, text) pair or a raised exception becomes a ShardError.
  template <typename... Args>
  static py::object call(const py::function& fn, Args&&... args) {
    try {
      py::object out = fn(std::forward<Args>(args)...);
      if (py::isinstance<py::tuple>(out) && py::len(out) == 2 &&
          py::isinstance<py::str>(out.cast<py::tuple>()[0])) {
        auto t = out.cast<py::tuple>();
        throw worker::ShardError(py::str(t[0]).cast<std::string>(),
                                 py::str(t[1]).cast<std::string>());
      }
      return out;
    } catch (py::error_already_set& e) {
      // Raised past the worker's own handler (it formats the ordinary ones).
      throw worker::ShardError(py::str(e.type().attr("__name__")).cast<std::string>(), e.what());
    }
  }

  py::function begin_, pass_, publish_, unreached_;
  const std::vector<torch::Tensor>* params_ = nullptr;  // trackParams'; owned by the participant
  std::vector<int64_t> versions_;  // their .grad's versions before the shard's passes
  bool begun_ = false, last_alone_ = false, last_train_ = true;  // the last begin()'s shard
  const ipc::Segment& seg_;
  worker::StepThreads threads_;  // the placement's threads per step
  bool in_trainer_;
  PyShard shard_;                                      // the current shard, as Python sees it
  const std::unique_ptr<PlainPass>* plain_ = nullptr;  // the participant's (usePlainPass)
};

// One eager worker's handle on its engine: the mapping, its slot's participant, and
// tensors over the shared buffers.
class EagerParticipant {
 public:
  EagerParticipant(const std::string& name, uint32_t slot, int parent_pid)
      : seg_(ipc::Segment::open(name)), slot_(slot) {
    participant_ = std::make_unique<worker::StepParticipant>(*seg_, slot, parent_pid);
    SHMGRAD_CHECK(seg_->header()->worker_kind == static_cast<uint32_t>(ipc::WorkerKind::kEager),
                  ErrorKind::kInvalidArgument, "engine '", name,
                  "' runs TorchScript workers, not eager ones");
  }

  // Over this worker's step memory: the segment's, or a device's (engines with devices).
  std::vector<torch::Tensor> views(float* base, int tensor_device) const {
    auto keep = seg_;
    return views::parameterShapedViews(
        *seg_, base, [keep](void*) {}, tensor_device);
  }
  const gpu::EngineMemory& memory() const { return participant_->memory(); }
  // The CUDA device index this worker's tensors are on, -1 for CPU tensors.
  int device() const { return memory().tensorDevice(memory().ordinal(slot_)); }
  std::vector<std::string> parameterNames() const {
    std::vector<std::string> out;
    const ipc::ParamEntry* table = seg_->paramTable();
    for (uint32_t i = 0; i < seg_->header()->num_params; ++i) out.emplace_back(table[i].name);
    return out;
  }

  int serve(py::function begin, py::function compute_pass, py::function publish_buffers,
            py::function unreached) {
    PyShardComputer computer(std::move(begin), std::move(compute_pass), std::move(publish_buffers),
                             std::move(unreached), *seg_);
    if (!watched_.empty()) computer.trackParams(&watched_);
    computer.usePlainPass(&plain_);
    py::gil_scoped_release nogil;
    return participant_->serve(computer);
  }

  // The trainer's side of the in-trainer placement (engine/trainer.h, setInTrainer): this
  // participant is the engine's trainer slot, in the trainer process, and these are the
  // job's compute functions (python/shmgrad/_in_trainer.py).
  void prepareInTrainer(py::function begin, py::function compute_pass, py::function publish_buffers,
                        py::function unreached) {
    SHMGRAD_CHECK(seg_->header()->trainer_slots == 1 && slot_ == ipc::trainerSlot(*seg_->header()),
                  ErrorKind::kInvalidArgument, "slot ", slot_, " is not engine '",
                  seg_->engineName(), "''s trainer slot");
    in_trainer_ = std::make_unique<PyShardComputer>(std::move(begin), std::move(compute_pass),
                                                    std::move(publish_buffers),
                                                    std::move(unreached), *seg_, true);
    if (!watched_.empty()) in_trainer_->trackParams(&watched_);
    in_trainer_->usePlainPass(&plain_);
  }

  // Lets go of the trainer's compute functions and the plain pass (Client.close): they
  // hold the runner, whose model holds this participant, a cycle through C++ that Python's
  // collector cannot see, which would keep the segment mapped for the process's life.
  void releaseInTrainer() {
    in_trainer_.reset();
    plain_.reset();
  }

  // The runner's common pass, taken without its Python from now on (PlainPass's fields).
  // Called with the GIL held, between steps.
  void setPlainPass(py::object model, py::object loss, py::object finish, py::object describe,
                    bool mean, std::optional<std::pair<torch::Tensor, torch::Tensor>> data) {
    auto p = std::make_unique<PlainPass>();
    p->model = std::move(model);
    p->loss = std::move(loss);
    p->finish = std::move(finish);
    p->describe = std::move(describe);
    p->mean = mean;
    if (data) std::tie(p->data_inputs, p->data_targets) = *data;
    plain_ = std::move(p);
  }

  // Step e, computed here on `threads` intra-op threads (0: as the process has them), which
  // the process has again afterwards. Called by Trainer::run without the GIL.
  void runInTrainer(uint32_t e, uint32_t threads, const ipc::LocalBatch& batch) {
    SHMGRAD_CHECK(in_trainer_ != nullptr, ErrorKind::kInvalidArgument,
                  "prepare_in_trainer was not called");
    worker::withIntraOpThreads(threads, [&] { participant_->runStep(e, *in_trainer_, batch); });
  }

  // Hooks the model's parameters (the engine's, in order): their gradients' completion in
  // backward starts the bucketed reduction's buckets.
  void watchGradients(const std::vector<torch::Tensor>& params) {
    hooks_.watch(*participant_, params);
    watched_ = params;
    if (in_trainer_ != nullptr) in_trainer_->trackParams(&watched_);
  }

  std::shared_ptr<ipc::Segment> seg_;
  uint32_t slot_;
  std::unique_ptr<worker::StepParticipant> participant_;
  worker::GradReadyHooks hooks_;        // after participant_: removed before it goes
  std::vector<torch::Tensor> watched_;  // watchGradients' parameters (host workers)
  std::unique_ptr<PyShardComputer> in_trainer_;
  std::unique_ptr<PlainPass> plain_;  // setPlainPass's; its objects released with the GIL
};

}  // namespace

// The in-trainer step over `participant` (a _C.StepParticipant of the trainer slot, or a
// _C.ScriptInTrainer; kept alive by the Python client for as long as its trainer;
// python/binding.cc).
Trainer::InTrainerStep inTrainerStep(py::handle participant) {
  if (py::isinstance<worker::ScriptInTrainer>(participant)) {
    worker::ScriptInTrainer* s = participant.cast<worker::ScriptInTrainer*>();
    return [s](uint32_t e, uint32_t threads, const ipc::LocalBatch& b) { s->run(e, threads, b); };
  }
  EagerParticipant* p = participant.cast<EagerParticipant*>();
  return [p](uint32_t e, uint32_t threads, const ipc::LocalBatch& b) {
    p->runInTrainer(e, threads, b);
  };
}

void bindEagerWorker(py::module_& m) {
  m.attr("EXIT_STOPPED") = worker::kExitStopped;
  m.attr("EXIT_COORDINATOR_GONE") = worker::kExitCoordinatorGone;
  m.attr("EXIT_STARTUP_FAILED") = worker::kExitStartupFailed;
  // worker/process.h: the process set-up every kind of worker shares.
  m.def("die_with_parent", &worker::dieWithParent, py::arg("parent_pid"),
        "SIGKILL when the coordinator exits; False if it is gone already");
  m.def("keep_freed_memory", &worker::keepFreedMemory,
        "glibc keeps freed memory in the heap (mallopt; see HEAP_ENVIRONMENT)");
  m.def("configure_threads", &worker::configureThreads, py::arg("threads"),
        "threads intra-op threads and one inter-op thread, as every worker runs");
  py::dict heap;
  for (const worker::HeapSetting& s : worker::kHeapSettings) heap[s.env] = std::to_string(s.value);
  m.attr("HEAP_ENVIRONMENT") = heap;
  // A shard's kind of batch, named as ipc::kBatchKindNames names it.
  py::enum_<ipc::BatchKind> batch_kinds(m, "BatchKind");
  for (uint32_t k = 1; k <= ipc::kNumBatchKinds; ++k) {
    batch_kinds.value(ipc::kBatchKindNames[k], static_cast<ipc::BatchKind>(k));
  }
  py::class_<PyShard>(m, "Shard")
      .def_readonly("begin", &PyShard::begin)
      .def_readonly("end", &PyShard::end)
      .def_readonly("epoch", &PyShard::epoch)
      .def_readonly("rank", &PyShard::rank)
      .def_readonly("participants", &PyShard::participants)
      .def_readonly("max_examples_per_pass", &PyShard::max_examples_per_pass)
      .def_readonly("grad_scale", &PyShard::grad_scale)
      .def_readonly("grads_in_reduced", &PyShard::grads_in_reduced)
      .def_readonly("seed", &PyShard::seed)
      .def_readonly("train", &PyShard::train)
      .def_readonly("kind", &PyShard::kind)
      .def_readonly("indices", &PyShard::indices)
      .def_readonly("inputs", &PyShard::inputs)
      .def_readonly("targets", &PyShard::targets)
      .def_readonly("leaves", &PyShard::leaves)
      .def_readonly("structure", &PyShard::structure);

  m.def(
      "rewrite_linears",
      [](const std::string& path) {
        torch::jit::Module module = worker::loadModel(path);
        const int count = worker::rewriteLinears(module);
        std::string graphs;
        for (const torch::jit::Module& m : module.modules()) {
          for (const torch::jit::Method& method : m.get_methods())
            graphs += method.graph()->toString();
        }
        return py::make_tuple(count, graphs);
      },
      py::arg("path"),
      "for tests: a TorchScript file's model as a replica loads it, its aten::linear nodes "
      "rewritten into shmgrad::linear (worker/direct_linear.h): (nodes rewritten, the graphs "
      "of every module's methods)");

  py::class_<worker::ScriptInTrainer>(
      m, "ScriptInTrainer",
      "A TorchScript engine's trainer slot computed in this process (worker/worker_loop.h), "
      "for Trainer.set_in_trainer")
      .def(py::init<const std::string&, int>(), py::arg("name"), py::arg("coordinator_pid"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<EagerParticipant>(m, "StepParticipant")
      .def(py::init<const std::string&, uint32_t, int>(), py::arg("name"), py::arg("slot"),
           py::arg("parent_pid"))
      .def_property_readonly(
          "job_path",
          [](const EagerParticipant& p) { return std::string(p.seg_->header()->job_path); })
      .def_property_readonly(
          "threads_per_worker",
          [](const EagerParticipant& p) { return p.seg_->header()->threads_per_worker; })
      .def_property_readonly("dataset_size",
                             [](const EagerParticipant& p) { return p.seg_->header()->data_count; })
      .def_property_readonly(
          "numerics",
          [](const EagerParticipant& p) {
            return ipc::numericsText(ipc::checkedNumerics(p.seg_->header()->control.numerics));
          },
          "the trainer's torch numerics to compute with (ipc::parseNumerics's text), or '' "
          "for torch's defaults")
      .def("parameter_names", &EagerParticipant::parameterNames)
      .def_property_readonly("device", &EagerParticipant::device,
                             "the CUDA device index this worker computes on, or -1 for the CPU")
      .def(
          "parameter_views",
          [](const EagerParticipant& p) { return p.views(p.memory().params(p.slot_), p.device()); })
      .def("slot_views",
           [](const EagerParticipant& p) { return p.views(p.memory().slot(p.slot_), p.device()); })
      .def("reduced_views",
           [](const EagerParticipant& p) {
             // A worker uses them only when alone on the trainer's device (Shard::alone).
             return p.views(p.memory().reduced(),
                            p.memory().tensorDevice(p.memory().trainerOrdinal()));
           })
      .def(
          "publish_loss_reduction",
          [](EagerParticipant& p, const std::string& name) {
            // Once, after this worker found it out: the first answer stays.
            uint32_t unknown = static_cast<uint32_t>(ipc::LossReduction::kUnknown);
            p.seg_->header()->control.loss_reduction.compare_exchange_strong(
                unknown, static_cast<uint32_t>(ipc::parseLossReduction(name)));
          },
          py::arg("name"))
      .def("report_startup_failure",
           [](EagerParticipant& p, const std::string& text) {
             p.participant_->reportStartupFailure(text);
           })
      .def("watch_gradients", &EagerParticipant::watchGradients, py::arg("params"),
           "hook the parameters' gradient accumulators (the engine's parameters, in order): "
           "backward's completed buckets are reduced while it runs")
      .def(
          "direct_linear",
          [](EagerParticipant& p, const torch::Tensor& x, const torch::Tensor& weight,
             const std::optional<torch::Tensor>& bias, int64_t w_index, int64_t b_index) {
            return worker::directLinear(p.participant_.get(), x, weight, bias, w_index, b_index);
          },
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("w_index"), py::arg("b_index"),
          "F.linear(x, weight, bias) (bias None: none), its parameters' gradients computed "
          "into their .grad where the step protocol takes a first write (_direct.py)")
      .def("become_ready", [](EagerParticipant& p) { return p.participant_->becomeReady(); })
      .def(
          "dataset_views",
          [](const EagerParticipant& p) -> py::object {
            auto keep = p.seg_;
            auto [inputs, targets] = views::datasetViews(*p.seg_, [keep](void*) {});
            if (!inputs.defined()) return py::none();
            return py::make_tuple(inputs, targets);
          },
          "(inputs, targets) over the dataset the coordinator loaded into the segment "
          "(dataset='fashion-mnist', ...), or None")
      .def("buffer_views",
           [](const EagerParticipant& p) {
             auto keep = p.seg_;
             return views::sharedBufferViews(*p.seg_, [keep](void*) {});
           })
      .def(
          "buffer_block",
          [](const EagerParticipant& p) {
            auto keep = p.seg_;
            return views::bufferBlockView(*p.seg_, [keep](void*) {});
          },
          "the shared buffers' region as one uint8 tensor")
      .def(
          "slot_buffer_block",
          [](const EagerParticipant& p) {
            auto keep = p.seg_;
            return views::bufferBlockView(
                *p.seg_, [keep](void*) {}, p.seg_->slotBuffers(p.slot_));
          },
          "this slot's copy of the shared buffers as one uint8 tensor")
      .def(
          "buffer_views_of",
          [](const EagerParticipant& p, const torch::Tensor& block) {
            return views::bufferViewsOf(*p.seg_, block);
          },
          py::arg("block"), "views of the buffers over a uint8 tensor laid out as that region")
      .def("set_plain_pass", &EagerParticipant::setPlainPass, py::arg("model"), py::arg("loss"),
           py::arg("finish"), py::arg("describe"), py::arg("mean"), py::arg("data"),
           "the runner's common pass, taken in C++ from now on: loss(model(x), y); "
           "finish(out, examples, shard) for what is not a loss tensor; describe(exc) for "
           "an error's text; mean: the loss is a mean over its examples; data: the "
           "segment's (inputs, targets) or None")
      .def("release_in_trainer", &EagerParticipant::releaseInTrainer,
           "after the trainer closed: drop prepare_in_trainer's functions and the plain pass")
      .def("prepare_in_trainer", &EagerParticipant::prepareInTrainer, py::arg("begin"),
           py::arg("compute_pass"), py::arg("publish_buffers"), py::arg("unreached"),
           "this participant is the trainer slot, computed in the trainer process")
      .def("serve", &EagerParticipant::serve, py::arg("begin"), py::arg("compute_pass"),
           py::arg("publish_buffers"), py::arg("unreached"),
           "Serves steps until the engine stops, the slot is retired or the coordinator dies; "
           "returns the exit code. begin(shard) once per shard, compute_pass(shard, begin, "
           "end) per pass of the shard (the protocol makes the passes), unreached() after the "
           "passes (the indices of the parameters backward did not reach: a list) and "
           "publish_buffers(to_slot) (to_slot: False, the step's first participant after the "
           "compute barrier; True, every participant before it, when the buffers are averaged) "
           "run with the GIL held.");
}

}  // namespace shmgrad
