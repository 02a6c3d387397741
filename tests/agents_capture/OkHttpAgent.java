// A test agent on OkHttp (as many JVM LLM clients use it), which ignores HTTPS_PROXY like the JDK's clients:
// `java -cp OKHTTP_JARS OkHttpAgent.java` (OkHttp 3 or 4: the calls used here are in both). One chat call to https://api.openai.com; the answer's content is printed.
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import okhttp3.MediaType;
import okhttp3.OkHttpClient;
import okhttp3.Request;
import okhttp3.RequestBody;
import okhttp3.Response;

public class OkHttpAgent {
    public static void main(String[] args) throws Exception {
        String body = "{\"model\":\"gpt-4o-mini\",\"messages\":[{\"role\":\"user\",\"content\":\"hi from okhttp\"}]}";
        Request request = new Request.Builder()
            .url("https://api.openai.com/v1/chat/completions")
            .header("Authorization", "Bearer " + System.getenv().getOrDefault("OPENAI_API_KEY", "sk-none"))
            .post(RequestBody.create(MediaType.get("application/json"), body))
            .build();
        OkHttpClient client = new OkHttpClient();
        try (Response response = client.newCall(request).execute()) {
            Matcher m = Pattern.compile("\"content\": ?\"([^\"]*)\"").matcher(response.body().string());
            System.out.println("okhttp: " + (m.find() ? m.group(1) : response.code()));
        }
        client.dispatcher().executorService().shutdown();
        client.connectionPool().evictAll();
    }
}
